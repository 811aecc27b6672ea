"""The embedded default model: a tiny Qwen2 built locally, once, and cached.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with `tokenizers` on a fixed,
sorted list of Python standard-library sources (the same text on every machine with the same
Python), the weights are a seeded random init, and the chat template is Qwen2.5's (ChatML with
tool calls). The result is an
ordinary Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer files) that
vLLM and transformers load like any other model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sysconfig
import tempfile
from pathlib import Path

EMBEDDED_NAME = "embedded-qwen2-v2"
"""Cache folder name; bump the suffix whenever the recipe below changes (v2: v1's tokenizer and
weights, the chat template with tools)."""

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    # Qwen2.5-Instruct's template (ChatML; tools declared in the system turn, calls as
    # <tool_call> JSON blocks, results as <tool_response> blocks in a user turn), without its
    # default system prompt. The tags are plain text here (several BPE tokens each): vLLM's
    # `hermes` tool parser reads them from the text.
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Architecture: head_dim 32 (head_dim 16 is unsupported by vLLM's CPU attention, NOTES.md).
ARCH = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
_CORPUS_DIRS = ["json", "email", "http", "logging", "unittest", "asyncio", "xml"]


def _corpus_files() -> list[str]:
    """Sorted stdlib source files used to train the tokenizer (deterministic per Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    for name in _CORPUS_DIRS:
        files.extend(sorted(str(p) for p in (root / name).rglob("*.py")))
    if not files:
        raise FileNotFoundError(f"no standard-library sources under {root}")
    return files


def _train_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def _build_weights(out_dir: Path, vocab_size: int, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        **ARCH,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(str(out_dir))


def embedded_model_dir(cache_dir: str | Path) -> Path:
    """Where the embedded model lives (built or not)."""
    return Path(cache_dir) / EMBEDDED_NAME


def ensure_embedded_model(cache_dir: str | Path, seed: int = 0) -> Path:
    """Build the embedded model under ``cache_dir`` unless it is there already.

    The build goes to a temporary sibling folder that is renamed into place, so a crashed
    build never leaves a half model behind and concurrent builders do not clash.

    Returns:
        The model directory (``config.json``, ``model.safetensors``, tokenizer, chat template).
    """
    target = embedded_model_dir(cache_dir)
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}.", dir=str(target.parent)))
    os.chmod(tmp, 0o755)
    try:
        _train_tokenizer(tmp)
        vocab_size = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
        _build_weights(tmp, vocab_size=vocab_size, seed=seed)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
"""A Hugging Face hub model id (``owner/name``), matched whole, as ``vllm serve MODEL`` takes one."""


def resolve_model_path(path: str | None, cache_dir: str | Path) -> Path:
    """The model directory to serve and train: ``path`` if given (a local directory, or a hub id
    ``owner/name`` that is not one), else the embedded model.

    A hub id resolves as ``vllm serve`` resolves it, through ``huggingface_hub``'s cache
    (``HF_HUB_CACHE`` / ``HF_HOME``): the cached snapshot when there is one; else it is downloaded,
    unless the machine is offline (``HF_HUB_OFFLINE=1``: huggingface_hub's own switch). Nothing
    else in the service downloads anything.

    Raises:
        FileNotFoundError: ``path`` is neither a model directory (one with ``config.json``) nor
            a hub id that is cached or can be downloaded (the message is one line, and says which).
    """
    if not path:
        return ensure_embedded_model(cache_dir)
    p = Path(path).expanduser()
    if p.exists() or not HUB_ID.fullmatch(path):
        p = p.resolve()
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")
        return p
    return _hub_snapshot(path)


def _hub_snapshot(repo_id: str, hub_cache: str | Path | None = None) -> Path:
    """The directory of hub model ``repo_id``'s snapshot: cached (in ``hub_cache``, default
    huggingface_hub's), else downloaded when online.

    Raises:
        FileNotFoundError: not cached and offline, not found on the hub, or unreachable.
    """
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=hub_cache, local_files_only=True))
    except LocalEntryNotFoundError:
        if offline:
            raise FileNotFoundError(f"{repo_id} is not a model directory and not in the Hugging Face cache, "
                                    "and HF_HUB_OFFLINE is set: download it first (`hf download "
                                    f"{repo_id}`) or pass its directory") from None
        try:
            snapshot = Path(snapshot_download(repo_id, cache_dir=hub_cache))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
            raise FileNotFoundError(f"{repo_id} is not a model directory and could not be downloaded from "
                                    f"the Hugging Face hub ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not (snapshot / "config.json").exists():
        raise FileNotFoundError(f"{repo_id}'s snapshot {snapshot} has no config.json: not a model")
    return snapshot
