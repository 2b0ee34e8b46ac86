import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_modules_are_up_to_date(tmp_path):
    subprocess.run([sys.executable, ROOT / "scripts" / "gen-proto", tmp_path], check=True, capture_output=True)
    fresh = {f.name: f.read_text() for f in tmp_path.iterdir()}
    committed = {name: (ROOT / "proto" / name).read_text() for name in fresh}
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert fresh and not stale, f"run scripts/gen-proto: {stale} differ from proto/kubemoe/v1/*.proto"


def test_operator_folder_never_shadows_the_standard_library():
    # Even from the repository root, where the folder `operator/` sits in the working directory.
    code = "import operator, kubemoe.operator; print(operator.__file__); print(list(kubemoe.operator.__path__)[0])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    stdlib, ours = out.split()
    assert "site-packages" not in stdlib and not stdlib.startswith(str(ROOT)), stdlib
    assert Path(ours).resolve() == ROOT / "operator"  # through the link kubemoe/operator -> ../operator
