import json

import pytest
from transformers import AutoTokenizer

from lowbit.calibrate.data import builtin_texts, load_texts, token_batches
from lowbit.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir):
    return AutoTokenizer.from_pretrained(embedded_model_dir)


@pytest.mark.parametrize("name", ["boolq", "lambada"])
def test_calibration_and_heldout_text_are_disjoint(name):
    calib, held = builtin_texts(name, "calib"), builtin_texts(name, "heldout")
    assert len(calib) > 500 and len(held) >= 1000
    assert not set(calib) & set(held)


def test_same_arguments_give_same_batches(tokenizer):
    texts = load_texts("builtin:boolq")
    a = token_batches(tokenizer, texts, 4, 128, seed=0)
    b = token_batches(tokenizer, texts, 4, 128, seed=0)
    c = token_batches(tokenizer, texts, 4, 128, seed=1)
    assert a == b and a != c
    assert len(a) == 4 and all(len(s) == 128 for s in a)


def test_jsonl_and_txt_sources(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": f"sentence number {i}."}) for i in range(50)))
    (tmp_path / "d.txt").write_text("\n\n".join(f"paragraph {i} of plain text." for i in range(50)))
    assert len(load_texts(str(tmp_path / "d.jsonl"))) == 50
    assert len(load_texts(str(tmp_path / "d.txt"))) == 50
    batches = token_batches(tokenizer, load_texts(str(tmp_path / "d.txt")), 2, 16)
    assert len(batches) == 2


def test_empty_and_bad_sources(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(UserError, match="holds no text"):
        load_texts(str(tmp_path / "empty.jsonl"))
    with pytest.raises(UserError, match=r"bad\.jsonl:1"):
        load_texts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(UserError, match="does not exist"):
        load_texts(str(tmp_path / "missing.txt"))
    with pytest.raises(UserError, match="unknown builtin"):
        load_texts("builtin:nope")
