"""Write small random-weight Hugging Face checkpoints (nothing can be downloaded here).

``write_tiny_checkpoint`` builds the model with ``transformers`` itself (so the reference of truth
loads it natively), saves it as safetensors in fp32, and trains a byte-level BPE tokenizer offline
on a synthetic English-like corpus generated from the seed. Everything is deterministic in
``(arch, size, seed)``: the same call writes the same bytes.

Random models have almost flat logits under the usual init (std 0.02), which makes greedy
decoding flip on rounding noise, and they echo their input. So the init is wider
(``_init_std``) and the final norm gets a gain (``_LOGIT_SCALE``): the top-1 logit margin is then
typically orders of magnitude above fp32 noise and greedy output is a varied sequence.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

Arch = Literal["qwen3", "qwen3-next"]
Size = Literal["tiny", "bench", "null", "0.6b", "0.6b-4"]

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# A chat template in Qwen3's shape, in this project's own words: ChatML turns; tools listed in the
# system turn, calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the hermes
# format of --tool-call-parser), tool results sent back in a user turn as <tool_response> blocks;
# reasoning as <think>...</think>, kept only for the turns after the last user message;
# `enable_thinking=false` closes an empty think block in the generation prompt. Plain conversations
# render exactly as ChatML.
CHAT_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set system_first = messages | length > 0 and messages[0]['role'] == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if system_first -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call the functions below. ' -}}
{{- 'Each one is described by a JSON schema inside <tools></tools>:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nTo call one, answer with a JSON object holding its name and arguments ' -}}
{{- 'between <tool_call></tool_call> tags, one pair of tags per call:\n<tool_call>\n' -}}
{{- '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- set content = m['content'] if m['content'] is string else '' -%}
{%- if m['role'] == 'system' and loop.first and tools -%}
{%- elif m['role'] == 'system' or m['role'] == 'user' -%}
{{- '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' -}}
{%- elif m['role'] == 'assistant' -%}
{%- set reasoning = m['reasoning_content'] if m['reasoning_content'] is string else '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\n' -}}
{%- if loop.index0 > ns.last_user and reasoning -%}
{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}
{%- endif -%}
{{- content -}}
{%- for call in (m['tool_calls'] or []) -%}
{%- set f = call['function'] if call['function'] is defined else call -%}
{%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + f['name'] + '", "arguments": ' -}}
{%- if f['arguments'] is string -%}{{- f['arguments'] -}}
{%- else -%}{{- f['arguments'] | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif m['role'] == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}
"""

# Gain given to the final RMSNorm after init: logits = norm(h) · W^T grow linearly with it
# (std ~ initializer_range * sqrt(hidden) * gain = 0.8 * gain ~ 5) while the residual stream is
# left untouched.
_LOGIT_SCALE = 6.0
# The hybrid model's fp32 rounding (chunked vs recurrent gated-delta forms) grows with the gain
# too; at 6 two correct implementations differ by ~1.5e-4, above the 1e-4 bar. 3 keeps margin.
_LOGIT_SCALE_HYBRID = 3.0


def _init_std(hidden: int) -> float:
    """Weight std with ``std * sqrt(hidden) = 0.8`` (0.1 at hidden 64).

    Much wider than the usual 0.02 so that the layers, not the input embedding, dominate the
    residual stream: with 0.02 a random model greedily repeats its last token forever. Scaling by
    width keeps every size's projections (and logits) in the same range.
    """
    return 0.8 / hidden**0.5


@dataclass(frozen=True, slots=True)
class _Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    corpus_lines: int
    # Rows of the embedding and the LM head when more than the tokenizer's vocabulary (0 = the
    # tokenizer's): real Qwen3 checkpoints pad their 151,669 tokens to 151,936 rows.
    model_vocab: int = 0


_SHAPES: dict[Size, _Shape] = {
    "tiny": _Shape(
        vocab=768, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, context=2048,
        corpus_lines=3000,
    ),
    # One thin layer over the tiny vocabulary: a forward that costs almost nothing, so that what a
    # served token costs is the control plane's (tokenizer, scheduler, worker bookkeeping). Heads
    # of 32: the smallest vLLM's CPU attention takes, so the peer server runs the same checkpoint.
    "null": _Shape(
        vocab=768, hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, head_dim=32, context=4096,
        corpus_lines=3000,
    ),
    "bench": _Shape(
        vocab=8192, hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4, head_dim=64, context=8192,
        corpus_lines=60000,
    ),
    # Qwen3-0.6B's shape (28 layers, hidden 1024, 16 heads / 8 KV heads of 128, its 151,936-row
    # vocabulary; untied head, see ``_model_config``): what a step costs on a GPU at a real size
    # (benchmarks/gpu_step.py). The tokenizer is the bench one; its ids are a subset of the rows.
    # About 3 GB of fp32 safetensors; qwen3 only.
    "0.6b": _Shape(
        vocab=8192, hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128, context=40960,
        corpus_lines=60000, model_vocab=151936,
    ),
    # The same widths and vocabulary, 4 of the 28 layers (~1.5 GB): the CPU servers compared at a
    # real layer shape and a real-width LM head, sampler and logits (services/bench/servers.py).
    "0.6b-4": _Shape(
        vocab=8192, hidden=1024, intermediate=3072, layers=4, heads=16, kv_heads=8, head_dim=128, context=40960,
        corpus_lines=60000, model_vocab=151936,
    ),
}

WORDS = (  # noqa: SIM905 (a word list reads better as prose)
    "the of and to in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father "
    "head stand own page should country found answer school grow study still learn plant cover food "
    "sun four between state keep eye never last let thought city tree cross farm hard start might "
    "story saw far sea draw left late run while press close night real life few north open seem "
    "together next white children begin got walk example ease paper group always music those both "
    "mark often letter until mile river car feet care second book carry took science eat room friend "
    "began idea fish mountain stop once base hear horse cut sure watch color face wood main enough "
    "plain girl usual young ready above ever red list though feel talk bird soon body dog family "
    "direct pose leave song measure door product black short numeral class wind question happen "
    "complete ship area half rock order fire south problem piece told knew pass since top whole king "
    "space heard best hour better true during hundred five remember step early hold west ground "
    "interest reach fast verb sing listen six table travel less morning ten simple several vowel "
    "toward war lay against pattern slow center love person money serve appear road map rain rule "
    "govern pull cold notice voice unit power town fine certain fly fall lead cry dark machine note "
    "wait plan figure star box noun field rest correct able pound done beauty drive stood contain "
    "front teach week final gave green oh quick develop ocean warm free minute strong special mind "
    "behind clear tail produce fact street inch multiply nothing course stay wheel full force blue "
    "object decide surface deep moon island foot system busy test record boat common gold possible "
    "plane stead dry wonder laugh thousand ago ran check game shape equate hot miss brought heat snow "
    "tire bring yes distant fill east paint language among"
).split()
_NAMES = ("Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Trent", "Peggy", "Victor", "Walter")
_KEYS = ("name", "age", "city", "items", "ok", "id", "value", "tags")


_ONSETS = ("", "b", "br", "c", "ch", "d", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "pl", "r", "s", "sh",
           "st", "t", "th", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck")


def _lexicon(rng: random.Random, size: int) -> list[str]:
    """Invented words of 1-4 syllables: enough distinct material for an 8k-token BPE vocabulary."""
    words = []
    for _ in range(size):
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        words.append("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                             for _ in range(syllables)))
    return words


def _sentence(rng: random.Random, lexicon: list[str]) -> str:
    # Common words most of the time; invented ones Zipf-like (low indices far more frequent).
    words = [
        rng.choice(WORDS) if rng.random() < 0.7 else lexicon[int(len(lexicon) * rng.random() ** 3)]
        for _ in range(rng.randint(4, 14))
    ]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2025)))
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text + rng.choice((".", ".", ".", "?", "!", ",", ";", ":"))


def _json_line(rng: random.Random) -> str:
    fields = []
    for key in rng.sample(_KEYS, rng.randint(1, 4)):
        word = f'"{rng.choice(WORDS)}"'
        value = rng.choice((word, str(rng.randint(0, 999)), "true", "false", "null", "[1, 2]"))
        fields.append(f'"{key}": {value}')
    return "{" + ", ".join(fields) + "}"


def corpus(lines: int, seed: int) -> Iterator[str]:
    """A deterministic English-like corpus: sentences, a little JSON, chat-formatted turns."""
    rng = random.Random(seed)
    lexicon = _lexicon(rng, max(100, lines // 4))
    for _ in range(lines):
        r = rng.random()
        if r < 0.1:
            yield _json_line(rng)
        elif r < 0.2:
            role = rng.choice(("system", "user", "assistant"))
            yield f"{IM_START}{role}\n{_sentence(rng, lexicon)}{IM_END}\n"
        else:
            yield " ".join(_sentence(rng, lexicon) for _ in range(rng.randint(1, 3)))


def _train_tokenizer(shape: _Shape, seed: int, out: Path) -> tuple[int, dict[str, int]]:
    """Train and save tokenizer.json + tokenizer_config.json; return (vocab size, special ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(shape.corpus_lines, seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tok.token_to_id(t)
        if token_id is None:  # cannot happen: trainers always add the special tokens first
            raise RuntimeError(f"tokenizer training lost special token {t!r}")
        ids[t] = token_id
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": shape.context,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size(), ids


def _model_config(arch: Arch, size: Size, shape: _Shape, vocab: int, ids: dict[str, int]) -> Any:
    from transformers import Qwen3Config, Qwen3NextConfig

    common: dict[str, Any] = {
        "vocab_size": max(vocab, shape.model_vocab),
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.context,
        "rms_norm_eps": 1e-6,
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "bos_token_id": None,
        "dtype": "float32",
        "initializer_range": _init_std(shape.hidden),
        # Untied: a tied random model echoes its input token (its logits favour the token it embeds).
        "tie_word_embeddings": False,
    }
    if arch == "qwen3":
        return Qwen3Config(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    small = size != "bench"
    return Qwen3NextConfig(
        **common,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        layer_types=[
            "full_attention" if (i + 1) % (2 if small else 4) == 0 else "linear_attention"
            for i in range(shape.layers)
        ],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16 if small else 64,
        linear_value_head_dim=16 if small else 64,
        linear_num_key_heads=2 if small else 4,
        linear_num_value_heads=4 if small else 8,
        num_experts=4 if small else 8,
        num_experts_per_tok=2,
        moe_intermediate_size=32 if small else 256,
        shared_expert_intermediate_size=64 if small else 512,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


def write_tiny_checkpoint(
    arch: Arch,
    size: Size,
    out: Path,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a random-weight ``arch`` checkpoint of ``size`` into directory ``out``; return ``out``.

    The directory gets ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32),
    ``tokenizer.json`` and ``tokenizer_config.json`` (Qwen chat template, eos ``<|im_end|>``).
    Existing files of those names are overwritten. ``progress`` receives one line per stage
    (default: stderr for ``bench``, silent for ``tiny``).
    """
    if arch not in ("qwen3", "qwen3-next"):
        raise ValueError(f"arch must be 'qwen3' or 'qwen3-next', got {arch!r}")
    if size not in _SHAPES:
        raise ValueError(f"size must be one of {sorted(_SHAPES)}, got {size!r}")
    if size.startswith("0.6b") and arch != "qwen3":
        raise ValueError(f"size {size!r} is Qwen3-0.6B's shape: arch must be 'qwen3', got {arch!r}")
    report = progress or (_stderr if size in ("bench", "0.6b", "0.6b-4") else _silent)
    shape = _SHAPES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    report(f"training a {shape.vocab}-token BPE tokenizer on {shape.corpus_lines} synthetic lines")
    vocab, ids = _train_tokenizer(shape, seed, out)

    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _model_config(arch, size, shape, vocab, ids)
    report(f"building {arch} ({size}) in {time.monotonic() - t0:.1f}s so far")
    # fork_rng keeps the caller's global RNG untouched while making the init depend on seed only.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            # Qwen3's norm multiplies by ``weight``; Qwen3-Next's by ``1 + weight``.
            norm = model.model.norm.weight
            norm.fill_(_LOGIT_SCALE if arch == "qwen3" else _LOGIT_SCALE_HYBRID - 1.0)  # zero-centred: 1 + w
    model.generation_config = GenerationConfig(
        eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT], bos_token_id=None
    )
    n_params = sum(p.numel() for p in model.parameters())
    report(f"saving {n_params / 1e6:.1f}M parameters to {out}")
    model.save_pretrained(out, safe_serialization=True)
    if arch == "qwen3-next":
        add_mtp_head(out, seed)
    report(f"done in {time.monotonic() - t0:.1f}s")
    return out


MTP_FILE = "mtp.safetensors"


def add_mtp_head(model_dir: Path, seed: int = 0) -> bool:
    """Give a Qwen3-Next checkpoint random MTP weights in the released checkpoints' layout
    (``mtp.*``: see ``services/worker/models/qwen3_next_mtp.py``) and ``num_nextn_predict_layers: 1``.

    The tensors go to a file of their own, ``mtp.safetensors``, beside ``model.safetensors``:
    transformers reads ``model.safetensors`` alone (it ignores ``mtp.*`` anyway) and Strata's
    loader reads every ``*.safetensors``; a checkpoint written before the head existed is
    completed without touching its other bytes. Deterministic in ``seed``; the head's final norm
    gets the target's gain so that its logits are as peaked. Files are replaced atomically.
    Returns whether anything was written (False: the head is there already).
    """
    from safetensors.torch import save_file

    from services.worker.models.qwen3_next import Qwen3NextForCausalLM
    from services.worker.models.qwen3_next_mtp import PREFIX, Qwen3NextMtp

    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    config = json.loads(cfg_path.read_text())
    if (model_dir / MTP_FILE).is_file() and config.get("num_nextn_predict_layers") == 1:
        return False
    with torch.device("meta"):
        head = Qwen3NextMtp(config, Qwen3NextForCausalLM(config))
    gen = torch.Generator().manual_seed(seed + 1)
    std = float(config.get("initializer_range", _init_std(int(config["hidden_size"]))))
    tensors: dict[str, torch.Tensor] = {}
    for name, p in head.state_dict().items():
        if name == "norm.weight":
            t = torch.full(p.shape, _LOGIT_SCALE_HYBRID - 1.0)  # zero-centred: 1 + w
        elif name.endswith("norm.weight"):
            t = torch.zeros(p.shape)
        else:
            t = torch.randn(p.shape, generator=gen) * std
        tensors[PREFIX + name] = t.contiguous()
    tmp = model_dir / f".{MTP_FILE}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, model_dir / MTP_FILE)
    config["num_nextn_predict_layers"] = 1
    tmp = model_dir / f".config.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, cfg_path)
    return True


def refresh_chat_template(model_dir: Path) -> bool:
    """Give a checkpoint written by an older version of this module today's ``CHAT_TEMPLATE``.

    Only ``tokenizer_config.json`` changes (replaced atomically: readers see the old file or the
    new one): the template is the one part of a tiny checkpoint that has changed since the first
    ones were written. Returns whether the file was rewritten.
    """
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("chat_template") == CHAT_TEMPLATE:
        return False
    config["chat_template"] = CHAT_TEMPLATE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)
    return True


def _stderr(line: str) -> None:
    print(f"[tiny] {line}", file=sys.stderr, flush=True)


def _silent(line: str) -> None:
    pass
