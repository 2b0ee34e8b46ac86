from .cli import dev

dev(prog_name="python -m kubemoe.devcluster")
