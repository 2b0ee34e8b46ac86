import pytest
import torch
from transformers import AutoTokenizer

from kubemoe.frontend.sampling import SamplingParams, greedy_tokens, sample_next
from kubemoe.frontend.text import TextStream


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("mixtral"))


def stream_all(tokenizer, text, stop=()):
    stream = TextStream(tokenizer, stop)
    out = ""
    for token in tokenizer(text)["input_ids"]:
        out += stream.push(token)
        if stream.stopped:
            return out, True
    return out + stream.flush(), False


def test_deltas_add_up_to_the_text(tokenizer):
    text = "Experts scale one by one: 你好 🙂 done."
    assert stream_all(tokenizer, text) == (text, False)


def test_stop_string_cuts_and_is_never_emitted(tokenizer):
    out, stopped = stream_all(tokenizer, "The quick brown fox jumps over the lazy dog", stop=("fox j",))
    assert stopped and out == "The quick brown "


def test_held_back_prefix_is_released_when_no_stop_follows(tokenizer):
    out, stopped = stream_all(tokenizer, "foxes fox", stop=("fox jumps",))
    assert not stopped and out == "foxes fox"


def test_greedy_and_seeded_sampling():
    logits = torch.tensor([0.1, 3.0, 0.2, 2.9])
    assert sample_next(logits, SamplingParams(temperature=0), None) == 1
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample_next(logits, params, g) for g in [params.generator()] * 20]
    b = [sample_next(logits, params, g) for g in [params.generator()] * 20]
    assert a == b and set(a) <= {0, 1, 2, 3}


def test_a_temperature_too_small_for_float32_draws_the_argmax():
    """1e-40 scales a logit gap of 1 past float32's range: the draw is the limit (greedy), not NaN's failure."""
    logits = torch.tensor([0.1, 3.0, 0.2, 2.0])
    g = torch.Generator().manual_seed(0)
    for temperature in (1e-40, 1e-300, 1e-8):
        assert {sample_next(logits, SamplingParams(temperature=temperature, top_p=0.9, top_k=3), g)
                for _ in range(20)} == {1}


def test_greedy_rows_are_read_together_and_sampled_rows_left_out():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    assert greedy_tokens(logits, params) == {0: 1, 2: 2}
    assert greedy_tokens(logits, [SamplingParams(temperature=0)] * 3) == {0: 1, 1: 0, 2: 2}
    assert greedy_tokens(logits, [SamplingParams()] * 3) == {}


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.tensor([5.0, 4.0, -3.0, -3.0])
    g = torch.Generator().manual_seed(0)
    assert {sample_next(logits, SamplingParams(top_k=2), g) for _ in range(200)} == {0, 1}
    assert {sample_next(logits, SamplingParams(top_p=0.5), g) for _ in range(50)} == {0}


@pytest.mark.parametrize("kwargs, field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                            ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_deltas_equal_decoding_the_whole_generation(tokenizer, monkeypatch):
    """Decoding a window per token gives the text of decoding everything at once, for any ids
    (split characters, special tokens and spaces included), and each token decodes a bounded window."""
    from kubemoe.frontend import text

    gen = torch.Generator().manual_seed(3)
    vocab = len(tokenizer)
    calls = []
    original = text.decode_many

    def counting(tok, windows):
        calls.extend(len(ids) for ids in windows)
        return original(tok, windows)

    monkeypatch.setattr(text, "decode_many", counting)
    for _ in range(30):
        ids = torch.randint(0, vocab, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen).tolist()
        stream = TextStream(tokenizer)
        out = "".join(stream.push(i) for i in ids) + stream.flush()
        assert out == tokenizer.decode(ids, skip_special_tokens=True), ids
    assert max(calls) < 20  # a window, never the whole generation


def test_many_windows_decode_in_one_call_as_each_alone(tokenizer):
    """decode_many's batch (the Rust tokenizer's, one call) gives what transformers' decode gives per window."""
    from kubemoe.frontend.text import _backend, decode_many

    assert _backend(tokenizer) is not None  # the fast path is what this compares
    gen = torch.Generator().manual_seed(4)
    windows = [torch.randint(0, len(tokenizer), (int(n),), generator=gen).tolist()
               for n in torch.randint(0, 12, (64,), generator=gen)]
    assert decode_many(tokenizer, windows) == [tokenizer.decode(w, skip_special_tokens=True) for w in windows]
