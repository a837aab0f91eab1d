"""Serving recipes: a model + engine + flags + environment known to work on a class of rig.

The catalogue is files/recipes/<name>.toml, read with tomllib and validated into a frozen
`Recipe` (extra keys are errors). A recipe says which rigs it fits (card class, card count,
NVLink, platform) and renders into the exact command line the serving unit runs
(`engine_argv`): only engine flags that docs/sources.md ("Engine flags") quotes are used.

Facts from the source documents that the catalogue encodes (docs/sources.md quotes each):

- dual 3090 without NVLink: NCCL_P2P_DISABLE=1. MTP follows the evidence, not the topology: the
  failure log's MTP bought nothing because its INT4 MTP head was quantised (acceptance
  1.07-1.27), while the hardware notes' PCIe-only dual 20 GB pair ran MTP K=3; a recipe with
  MTP declares `speculative.mtp_head` and a quantised head is refused.
- 20 GB cards: --gpu-memory-utilization 0.82 and fp8_e5m2 KV (24 GB cards ship 0.95).
- WSL2 and NVLink rigs: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
  (rigbook.roles.wsl.serving_environment).
- vLLM drains for --shutdown-timeout 30 seconds on SIGTERM (and unlinks its /dev/shm buffer
  only then); the unit's TimeoutStopSec=120 stays above it.

Model pins: a recipe names a repo and a 40-hex revision. Where no real commit is known the
catalogue carries PLACEHOLDER_REVISION, and the rig must pin the repo in its `models` host data
(which the models role pulls); a rig's `models` entry always wins over the recipe's revision.
docs/recipes.md is generated from the catalogue (`rigbook docs`).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import json
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from rigbook import FILES
from rigbook.core.cards import (
    CLIFF2_MAX_CONTEXT,
    CLIFF2_VRAM_GIB,
    SM86,
    SM86_LONG_CONTEXT,
    SM90,
    SM90_KERNELS,
    Card,
    class_card,
)
from rigbook.core.envvars import env_problems
from rigbook.core.errors import RigbookError
from rigbook.core.messages import GIB, gib
from rigbook.core.pins import engine_pins, engine_venv, venv_link
from rigbook.core.spec import VRAM_GIB, GpuClass, ModelSpec, Platform, Rig
from rigbook.core.types import IpAddress, Line, LocalPath, StrictModel, Word
from rigbook.rigside.hfcache import snapshot_dir
from rigbook.roles.wsl import serving_environment

RECIPES_DIR = FILES / "recipes"

#: A revision that says "no real commit known": the rig must pin the repo in `models`.
PLACEHOLDER_REVISION = "0" * 40

#: vLLM drains in-flight requests this long on SIGTERM (--shutdown-timeout, vLLM >= 0.18).
VLLM_SHUTDOWN_TIMEOUT_S = 30

Engine = Literal["vllm", "sglang", "llama.cpp"]
#: The VenvSpec engine that serves each recipe engine.
VENV_ENGINE = {"vllm": "vllm", "sglang": "sglang", "llama.cpp": "llama-cpp-python"}

#: --kv-cache-dtype values the engines document (docs/sources.md, "Engine flags").
VLLM_KV_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4",
)
SGLANG_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "bf16")
#: The tool-call parsers each engine's own parser takes (docs/sources.md, "Tool-call parsers"):
#: vLLM's --tool-call-parser (vllm/tool_parsers/__init__.py, _TOOL_PARSERS_TO_REGISTER), SGLang's
#: --tool-call-parser (FunctionCallParser.ToolCallParserEnum) and the llama-cpp-python
#: --chat_format that parses tool calls with the GGUF's own tokenizer (the functionary formats
#: need a separate Hugging Face tokenizer rigbook does not pull).
TOOL_PARSERS: dict[str, tuple[str, ...]] = {
    "vllm": (
        "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31",
        "deepseek_v32", "deepseek_v4", "ernie45", "functiongemma", "gemma4", "gigachat3",
        "glm45", "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hunyuan_a13b",
        "hy_v3", "inkling", "internlm", "jamba", "kimi_k2", "kimi_k3", "lfm2", "llama3_json",
        "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2",
        "minimax_m3", "mistral", "olmo3", "openai", "phi4_mini_json", "poolside_v1", "pythonic",
        "qwen3_coder", "qwen3_xml", "seed_oss", "solar_open2", "step3", "step3p5", "xlam",
    ),
    "sglang": (
        "apertus2509", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32",
        "deepseekv4", "dots", "gemma4", "gigachat3", "gigachat35", "glm", "glm45", "glm47",
        "gpt-oss", "hermes", "hunyuan", "inkling", "interns1", "k2_horizon", "kimi_k2",
        "kimi_k3", "lfm2", "ling3", "llama3", "mimo", "minicpm5", "minimax-m2", "minimax-m3",
        "mistral", "muse", "poolside_v1", "pythonic", "qwen", "qwen25", "qwen3_coder", "spark25",
        "step3", "step3p5", "trinity",
    ),
    "llama.cpp": ("chatml-function-calling",),
}
#: The reasoning parsers each engine's --reasoning-parser takes (docs/sources.md, "Reasoning
#: parsers"): vLLM's _REASONING_PARSERS_TO_REGISTER (vllm/reasoning/__init__.py) and SGLang's
#: ReasoningParser.DetectorMap (python/sglang/srt/parser/reasoning_parser.py, the flag's
#: choices). llama-cpp-python's server has no reasoning parser.
REASONING_PARSERS: dict[str, tuple[str, ...]] = {
    "vllm": (
        "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4",
        "ernie45", "gemma4", "glm45", "glm47", "granite", "holo2", "hunyuan_a13b", "hy_v3",
        "inkling", "kimi_k2", "kimi_k3", "mimo", "minimax_m2", "minimax_m2_append_think",
        "minimax_m3", "mistral", "nemotron_v3", "olmo3", "openai_gptoss", "poolside_v1", "qwen3",
        "seed_oss", "solar_open2", "step3", "step3p5",
    ),
    "sglang": (
        "apertus2509", "cohere_command4", "deepseek-r1", "deepseek-v3", "deepseek-v4", "gemma4",
        "glm45", "gpt-oss", "hunyuan", "inkling", "interns1", "kimi", "kimi_k2", "kimi_k3",
        "mimo", "minimax", "minimax-append-think", "minimax-m3", "mistral", "nemotron_3",
        "poolside_v1", "qwen3", "qwen3-thinking", "step3", "step3p5", "telechat4",
    ),
    "llama.cpp": (),
}

#: Flags rigbook renders itself (model, address, key, context, memory, parallelism, tool and
#: reasoning parsers)
#: or that read a file of further flags (--config, --config_file), as each engine's parser
#: declares them, aliases included (docs/sources.md, "Engine flags"). extra_args may not carry
#: them in any spelling that parser takes for them (`owned_flags_of`).
OWN_FLAGS: dict[Engine, tuple[str, ...]] = {
    "vllm": (
        "--model", "--served-model-name", "--host", "--port", "--api-key",
        "--tensor-parallel-size", "-tp", "--max-model-len", "--gpu-memory-utilization",
        "--kv-cache-dtype", "--max-num-seqs", "--enable-chunked-prefill",
        "--max-num-batched-tokens", "--speculative-config", "--shutdown-timeout", "--config",
        "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
    ),
    "sglang": (
        "--model-path", "--model", "--host", "--port", "--api-key", "--tp-size",
        "--tensor-parallel-size", "--context-length", "--mem-fraction-static",
        "--kv-cache-dtype", "--config", "--tool-call-parser", "--reasoning-parser",
    ),
    "llama.cpp": (
        "--model", "--model_alias", "--host", "--port", "--api_key", "--n_ctx", "--n_gpu_layers",
        "--config_file", "--chat_format",
    ),
}
#: What argparse reads as a negative number, a value and never a flag (none of the engines
#: declares a flag that looks like one).
_NEGATIVE = re.compile(r"-\d+|-\d*\.\d+")



class ModelPin(StrictModel):
    """A model in the Hugging Face cache, pinned to one commit."""

    repo: str = Field(pattern=r"^[\w.-]+/[\w.-]+$", description="Hub repo id, ORG/NAME.")
    revision: str = Field(
        pattern=r"^[0-9a-f]{40}$",
        description="Commit (40 hex); all zeros = placeholder: the rig's `models` must pin it.",
    )
    file: str | None = Field(
        None,
        pattern=r"^[\w.-]+(/[\w.-]+)*\.gguf$",
        description="llama.cpp: the GGUF file inside the snapshot.",
    )
    served_name: Word | None = Field(
        None, description="Model id the API reports; none = the repo id (llama.cpp, vLLM)."
    )
    weights_gib: float = Field(gt=0, description="Size of the weights in GiB (preflight).")
    gdn: bool = Field(
        False,
        description="The model has Gated DeltaNet (GDN) linear-attention layers (Qwen3.6/3.8-27B, "
        "Qwen3-Next class): its venv must be CUDA 13.0 exactly, and the failure log's GDN traps "
        "are refused (docs/sources.md, GDN models).",
    )

    @property
    def placeholder(self) -> bool:
        return self.revision == PLACEHOLDER_REVISION


class Speculative(StrictModel):
    """vLLM speculative decoding, rendered as --speculative-config JSON."""

    method: Literal["draft_model", "mtp"] = Field(
        description="draft_model (a separate draft model) or mtp (the model's own MTP head)."
    )
    num_speculative_tokens: int = Field(ge=1, le=16, description="Tokens proposed per step.")
    min_acceptance_length: float = Field(
        1.5,
        ge=1,
        description="The floor of verify's `speculative` step: tokens per verification pass (1 + "
        "accepted / drafts, read from the engine's /metrics) below which the draft does not pay. "
        "The failure log's quantised MTP head accepted 1.07-1.27 where a working draft reached "
        "3.7-4.2; set it from a measurement of this configuration (docs/verify.md). At most 1 + "
        "num_speculative_tokens.",
    )
    mtp_head: Literal["unquantised", "quantised"] | None = Field(
        None,
        description="mtp only, required: how the checkpoint stores its MTP head, read from its "
        "model.safetensors.index.json (`mtp_head_of_index`): `...mtp....weight` = unquantised, "
        "`weight_packed` = quantised (refused: docs/sources.md, MTP).",
    )


#: The source documents docs/sources.md quotes.
SourceDocument = Literal["Hardware notes", "Failure log", "Runbook", "Facts sheet"]


class SourceRef(StrictModel):
    """Where a recipe's settings come from: a document, its section, the docs/sources.md topic."""

    document: SourceDocument = Field(description="The source document (docs/sources.md).")
    section: str = Field(min_length=1, description="Its section or paragraph.")
    topic: str = Field(
        min_length=1, description="The docs/sources.md section that quotes it (its heading)."
    )

    def markdown(self) -> str:
        return f"{self.document}, {self.section} ([{self.topic}](sources.md#{anchor(self.topic)}))"


def anchor(heading: str) -> str:
    """The link anchor a Markdown renderer gives a heading (GitHub's rule)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


class Fits(StrictModel):
    """The rigs a recipe is known to work on."""

    gpu_class: tuple[GpuClass, ...] = Field(
        (), description="Card classes it fits; empty = any (cpu_only recipes only)."
    )
    gpu_count: int | None = Field(
        None, ge=1, le=8, description="Exactly this many cards; none = any (cpu_only only)."
    )
    nvlink: Literal["required", "forbidden", "any"] = Field(
        "any", description="Whether the rig must (or must not) have a working NVLink bridge."
    )
    platforms: tuple[Platform, ...] = Field(description="Platforms it fits.")


class MeasuredOn(StrictModel):
    """What a source measured a configuration on: the cards and the engine build. A recipe
    whose `fits` or engine build differ (a copy with new `fits`, another venv) is another
    configuration, and no longer `measured`."""

    gpu_class: tuple[GpuClass, ...] = Field(
        min_length=1, description="The card classes the source measured it on."
    )
    gpu_count: int = Field(ge=1, le=8, description="How many cards it ran on.")
    engine: Engine = Field(description="The engine it ran on.")
    venv: str = Field(
        pattern=r"^[a-z0-9][a-z0-9_.-]*$",
        description="The venv rigbook ships the configuration with (files/venvs/pins.toml): a "
        "copy with another venv is another configuration.",
    )
    build: Line = Field(
        min_length=1,
        description="The engine build the source measured it on, in the source's words (`vLLM "
        "nightly with the notes' patches`), or as a pin (`vllm==0.29.0`). Unless it is one of "
        "the pins the venv installs, the figures are shown as the source's, measured on "
        "another build than the recipe's (docs/recipes.md).",
    )


class Estimate(StrictModel):
    """What the preflight checks against the rig's free memory (GiB)."""

    kv_gib: float = Field(
        ge=0, description="KV cache for max_model_len x max_num_seqs, all cards together."
    )
    overhead_gib: float = Field(
        1.5, ge=0, description="Per card: activations, CUDA graphs, runtime context."
    )
    host_ram_gib: float = Field(gt=0, description="Host RAM the engine needs while it loads.")


class Recipe(StrictModel):
    """One serving recipe (files/recipes/<name>.toml)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$", description="Its name; the file's stem.")
    description: str = Field(description="What it is for, and the facts behind its settings.")
    sources: tuple[SourceRef, ...] = Field(
        (),
        description="The source documents and sections its settings follow (docs/sources.md); "
        "empty = rigbook's own configuration, following no source.",
    )
    measured: bool = Field(
        False,
        description="It is a configuration a source measured (its model, flags and context): "
        "only such a recipe may quote figures, and only that configuration's; the catalogue "
        "lists these first.",
    )
    measured_on: MeasuredOn | None = Field(
        None,
        description="measured only, required: the cards and the engine build the source "
        "measured on (`fits` may not go beyond the cards; `engine` and `venv` are the ones it "
        "ships with; `build` says what the source ran).",
    )
    engine: Engine = Field(description="vllm, sglang or llama.cpp (llama-cpp-python's server).")
    venv: str = Field(
        pattern=r"^[a-z0-9][a-z0-9_.-]*$",
        description="Name of the serving venv (a `venvs` entry): /opt/rigbook/venvs/<venv>.",
    )
    cpu_only: bool = Field(
        False, description="Runs without a GPU (test recipes): the GPU checks are skipped."
    )
    model: ModelPin = Field(description="The model it serves.")
    draft: ModelPin | None = Field(None, description="A separate draft model for speculation.")
    speculative: Speculative | None = Field(None, description="vLLM speculative decoding.")
    tensor_parallel_size: int = Field(1, ge=1, le=8, description="Cards the model is split over.")
    max_model_len: int = Field(ge=256, description="Context length (vLLM/SGLang/llama.cpp).")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=0.98, description="vLLM/SGLang share of each card's memory it claims."
    )
    kv_cache_dtype: Word | None = Field(None, description="vLLM/SGLang --kv-cache-dtype.")
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM --max-num-seqs.")
    chunked_prefill: bool | None = Field(
        None, description="vLLM: true adds --enable-chunked-prefill; none = engine default."
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=256, description="vLLM --max-num-batched-tokens (the prefill chunk)."
    )
    tool_parser: Word | None = Field(
        None,
        description="The engine's parser of the model's tool calls (vLLM "
        "`--enable-auto-tool-choice --tool-call-parser`, SGLang `--tool-call-parser`, "
        "llama-cpp-python `--chat_format`), one of `rigbook.roles.recipes.TOOL_PARSERS` for its "
        "engine; set, verify runs the tool-call steps. None: the engine parses no tool calls.",
    )
    reasoning_parser: Word | None = Field(
        None,
        description="The engine's parser of the model's thinking (vLLM and SGLang "
        "`--reasoning-parser`), one of `rigbook.roles.recipes.REASONING_PARSERS` for its "
        "engine: the model thinks, and its reasoning comes apart from the answer "
        "(`reasoning_content` / `reasoning`); set, verify runs the `thinking` step and streams "
        "the tool call with thinking on. None: the model does not think, or its thinking stays "
        "in the text.",
    )
    extra_args: tuple[Line, ...] = Field(
        (),
        description="More engine arguments, verbatim. Each item that starts with `-` is a flag; "
        "a flag rigbook sets (model, address, key, context, memory, parallelism, a config file: "
        "`rigbook.roles.recipes.OWN_FLAGS`) is refused in every spelling the engine's parser takes "
        "for it: an abbreviation (`--hos`), vLLM's `_` for `-` and `--flag.key` (docs/sources.md, "
        "Engine flags).",
    )
    env: dict[str, Line] = Field({}, description="Engine environment (NCCL, allocator, ...).")
    port: int = Field(8000, ge=1024, le=65535, description="API port (serving_port overrides).")
    bind: IpAddress = Field(
        "127.0.0.1", description="API address (serving_bind overrides); wider needs a key."
    )
    api_key_file: LocalPath | None = Field(
        None, description="Operator-side API key file (serving_api_key_file overrides)."
    )
    fits: Fits = Field(description="The rigs it is known to work on.")
    estimate: Estimate = Field(description="Memory the preflight checks for.")

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        problems = (
            _engine_problems(self) + _model_problems(self) + _env_problems(self)
            + _gdn_problems(self) + _figure_problems(self) + _offload_problems(self)
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def models(self) -> tuple[ModelPin, ...]:
        return (self.model,) if self.draft is None else (self.model, self.draft)

    def served_name(self) -> str:
        return self.model.served_name or self.model.repo


def _engine_problems(r: Recipe) -> list[str]:
    problems = []
    vllm_only = {
        "max_num_seqs": r.max_num_seqs, "chunked_prefill": r.chunked_prefill,
        "max_num_batched_tokens": r.max_num_batched_tokens, "speculative": r.speculative,
    }
    if r.engine != "vllm":
        problems += [f"{key} is a vLLM setting" for key, v in vllm_only.items() if v is not None]
    if r.engine == "llama.cpp":
        if r.model.file is None:
            problems.append("llama.cpp needs model.file (the GGUF file)")
        if r.tensor_parallel_size != 1:
            problems.append("llama.cpp splits layers over all cards itself: tensor_parallel_size 1")
        for key in ("gpu_memory_utilization", "kv_cache_dtype"):
            if getattr(r, key) is not None:
                problems.append(f"{key} is not a llama.cpp setting")
    else:
        if r.cpu_only:
            problems.append("cpu_only recipes are llama.cpp recipes")
        if r.gpu_memory_utilization is None:
            problems.append(f"{r.engine} needs gpu_memory_utilization (its default drifted)")
        allowed = VLLM_KV_DTYPES if r.engine == "vllm" else SGLANG_KV_DTYPES
        if r.kv_cache_dtype is not None and r.kv_cache_dtype not in allowed:
            problems.append(f"kv_cache_dtype {r.kv_cache_dtype!r}; allowed: {', '.join(allowed)}")
    if r.tool_parser is not None and r.tool_parser not in TOOL_PARSERS[r.engine]:
        problems.append(f"tool_parser {r.tool_parser!r} is not a {r.engine} tool-call parser; "
                        f"allowed: {', '.join(TOOL_PARSERS[r.engine])}")
    if r.reasoning_parser is not None and r.reasoning_parser not in REASONING_PARSERS[r.engine]:
        allowed = ", ".join(REASONING_PARSERS[r.engine]) or f"none ({r.engine} has no parser)"
        problems.append(f"reasoning_parser {r.reasoning_parser!r} is not a {r.engine} reasoning "
                        f"parser; allowed: {allowed}")
    if r.engine == "sglang" and r.model.served_name is not None:
        problems.append("model.served_name: SGLang has no verified flag for it")
    if r.chunked_prefill is False:
        problems.append("chunked_prefill false has no verified flag; leave it unset")
    if not r.cpu_only and (not r.fits.gpu_class or r.fits.gpu_count is None):
        problems.append("a GPU recipe names fits.gpu_class and fits.gpu_count")
    if r.fits.gpu_count is not None and r.tensor_parallel_size > r.fits.gpu_count:
        problems.append(
            f"tensor_parallel_size {r.tensor_parallel_size} > fits.gpu_count {r.fits.gpu_count}"
        )
    return problems + _flag_problems(r)


def engine_flag(engine: str, arg: str) -> str | None:
    """The flag an extra_args item is to the engine's parser, normalised as that parser does
    (None: a value). Every item that starts with `-` is a flag, since argparse never takes one
    as the value of the flag before it; a negative number and a lone `-` are values. vLLM's
    FlexibleArgumentParser reads `--a.b=v` as `--a` with JSON {"b": v} and turns `_` into `-`
    in a long flag's name; SGLang's and llama-cpp-python's plain argparse parsers change
    nothing (docs/sources.md, "Engine flags")."""
    if not arg.startswith("-") or arg == "-" or _NEGATIVE.fullmatch(arg):
        return None
    flag = arg.split("=", 1)[0]
    if engine == "vllm":
        flag = flag.split(".", 1)[0]
        if flag.startswith("--"):
            flag = flag.replace("_", "-")
    return flag


def owned_flags_of(engine: str, flag: str) -> list[str]:
    """The owned flags the engine's argparse may read `flag` as: itself, or one it abbreviates
    (allow_abbrev, argparse's default, which none of the engines turns off, takes a prefix of a
    long flag, and of a single-dash one such as -tp). An ambiguous prefix is a usage error in
    argparse; it is refused here all the same, the safe side. argparse is case-sensitive, so
    --HOST is not --host (the engine exits on it as an unknown flag)."""
    return [own for own in OWN_FLAGS[engine] if own.startswith(flag)]


def _flag_problems(r: Recipe) -> list[str]:
    """extra_args against the flags rigbook owns, in every spelling the engine takes for them.

    A deny-list of prefixes, not an allow-list of the flags a recipe may pass: the engines
    declare hundreds of flags that change between releases, and rigbook pins their versions in
    files/venvs/pins.toml without shipping their parsers; an allow-list that was not read from
    each pinned parser would refuse good recipes or allow a flag by a name the parser takes for
    another.
    """
    problems = []
    for arg in r.extra_args:
        flag = engine_flag(r.engine, arg)
        if flag == "--":
            problems.append("extra_args: -- ends the engine's flags (what follows would not be "
                            "read as flags by argparse, but vLLM still reads --config after it); "
                            "leave it out")
        elif flag is not None and (owned := owned_flags_of(r.engine, flag)):
            problems.append(
                f"extra_args: {arg.split('=', 1)[0]} is set by rigbook from the recipe's own "
                f"keys: {r.engine}'s parser reads it as {' or '.join(owned)} (an owned flag is "
                "refused in every spelling and abbreviation its engine takes)"
            )
    return problems


#: A throughput or efficiency figure in a description: "82.4 TPS", "56 tok/s", "0.111 TPS/W",
#: the notes' "82.4 narr / 107.9 code TPS".
FIGURE = re.compile(
    r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s*(?:TPS|tok/s|tokens/s|(?:narr|code)\b)", re.I
)


def _figure_problems(r: Recipe) -> list[str]:
    """A figure belongs to the configuration it was measured on (docs/sources.md)."""
    if r.measured and not r.sources:
        return ["measured: a measured configuration names the source that measured it (sources)"]
    if r.measured:
        problem = _measured_on_problem(r)
        if problem:
            return [problem]
    elif r.measured_on is not None:
        return ["measured_on is for a measured configuration (measured = true)"]
    figures = FIGURE.findall(r.description)
    if figures and not r.measured:
        return [f"description quotes {', '.join(figures)}, but the recipe is not a configuration "
                "a source measured (measured = true): quote no borrowed figure"]
    return []


def _measured_on_problem(r: Recipe) -> str | None:
    """A measured recipe is the configuration its source measured: the cards and the engine
    build in measured_on. A copy with other `fits` or another venv is not (None: it is)."""
    on = r.measured_on
    if on is None:
        return ("measured_on: a measured configuration says what it was measured on (gpu_class, "
                "gpu_count, engine, venv, build)")
    differ = []
    if not set(r.fits.gpu_class) <= set(on.gpu_class) or r.fits.gpu_count != on.gpu_count:
        differ.append(f"fits {r.fits.gpu_count}x {'/'.join(r.fits.gpu_class)}, measured on "
                      f"{on.gpu_count}x {'/'.join(on.gpu_class)}")
    if (r.engine, r.venv) != (on.engine, on.venv):
        differ.append(f"engine {r.engine} venv {r.venv}, measured on {on.engine} venv {on.venv}")
    if not differ:
        return None
    return (f"measured: {'; '.join(differ)}: this is not the configuration its source measured "
            "(a copy with new fits or another engine build); set measured = false, drop "
            "measured_on and quote none of its figures")


def installed_packages(recipe: Recipe) -> tuple[str, ...]:
    """The pins of the venv a shipped recipe installs (files/venvs/pins.toml; empty: unknown)."""
    for pins in engine_pins().values():
        if pins.get("venv") == recipe.venv:
            return tuple(pins["packages"])
    return ()


def measured_on_its_build(recipe: Recipe) -> bool:
    """Whether the source measured the build the recipe installs: its figures are then the
    recipe's own; otherwise they are the source's, on another build."""
    on = recipe.measured_on
    return on is not None and on.build in installed_packages(recipe)


def figures_text(recipe: Recipe) -> str | None:
    """What a measured recipe's figures are, in the docs (None: it quotes none)."""
    on = recipe.measured_on
    if not recipe.measured or on is None:
        return None
    if measured_on_its_build(recipe):
        return f"measured by its source on `{on.build}`, the build this recipe installs"
    installs = ", ".join(f"`{p}`" for p in installed_packages(recipe)) or f"venv `{recipe.venv}`"
    return (f"the source's: measured on {on.build}; this recipe installs {installs}, a build no "
            "source measured, so they are not this recipe's figures")


#: vLLM's CPU KV-offload buffer, in GiB; vLLM keeps it in /dev/shm (the runbook's
#: vllm_offload_<uuid>.mmap, "sized by --kv-offloading-size").
KV_OFFLOAD_FLAG = "--kv-offloading-size"


def kv_offload_gib(recipe: Recipe) -> float | None:
    """The --kv-offloading-size a vLLM recipe's extra_args pass, in GiB (None: none)."""
    if recipe.engine != "vllm":
        return None
    args = list(recipe.extra_args)
    for i, arg in enumerate(args):
        if engine_flag("vllm", arg) != KV_OFFLOAD_FLAG:
            continue
        value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _offload_problems(r: Recipe) -> list[str]:
    size = kv_offload_gib(r)
    if size is None or r.estimate.host_ram_gib >= size:
        return []
    return [f"estimate.host_ram_gib {r.estimate.host_ram_gib:g} is below the {KV_OFFLOAD_FLAG} "
            f"{size:g} GiB buffer, which vLLM keeps in /dev/shm, in host RAM (the runbook's "
            "vllm_offload_<uuid>.mmap; docs/sources.md, Shutdown drain and /dev/shm): count it"]


def shm_offload_problem(recipe: Recipe, shm_size: str | None,
                        mem_total_bytes: int = 0) -> str | None:
    """The rig's shm_size against the recipe's KV-offload buffer (None: it holds it, or
    nothing to compare: no buffer, no shm_size, or a percentage without the host's RAM)."""
    from rigbook.roles.tuning import size_bytes  # tuning imports the roles this module feeds

    size = kv_offload_gib(recipe)
    if size is None or shm_size is None or (shm_size.endswith("%") and not mem_total_bytes):
        return None
    have = size_bytes(shm_size, mem_total_bytes)
    if have >= size * GIB:
        return None
    return (f"shm_size {shm_size} ({gib(have)}) cannot hold the recipe's "
            f"{KV_OFFLOAD_FLAG} {size:g} GiB buffer, which vLLM keeps in /dev/shm "
            "(docs/sources.md, Shutdown drain and /dev/shm); raise shm_size")


#: The runbook: CPU co-execution for weight offload "cannot pay" below this CPU/PCIe bandwidth
#: ratio (FreeToken's own rule; its X870E dual-channel desktop measured 1.15x).
OFFLOAD_PAYS_RATIO = 2.0
#: vLLM flags that put weights in host RAM for the GPU to read over PCIe.
WEIGHT_OFFLOAD_FLAGS = ("--cpu-offload-gb",)
#: The failure log: "A 2048 chunked-prefill size ... quadrupled prefill iterations on
#: single-request 50-90K contexts".
SMALL_CHUNK, LONG_SINGLE = 2048, 50_000


def recipe_warnings(recipe: Recipe, rig: Rig) -> list[str]:
    """What the sources say a recipe's own flags cost on one rig, short of refusing it."""
    found = []
    flags = {engine_flag(recipe.engine, arg) for arg in recipe.extra_args}
    for flag in WEIGHT_OFFLOAD_FLAGS:
        if recipe.engine == "vllm" and flag in flags:
            found.append(
                f"extra_args {flag}: weights offloaded to host RAM are read over PCIe; the "
                f"runbook's host measured CPU memory at 1.15x PCIe (a dual-channel desktop), "
                f"where offload \"cannot pay\" below {OFFLOAD_PAYS_RATIO:g}x: measure the "
                "rig's ratio before relying on it (docs/sources.md, CPU weight offload)")
    chunk = recipe.max_num_batched_tokens
    if (recipe.max_num_seqs == 1 and chunk is not None and chunk <= SMALL_CHUNK
            and max_model_len_of(recipe, rig) >= LONG_SINGLE):
        found.append(
            f"max_num_batched_tokens {chunk} for one sequence of up to "
            f"{max_model_len_of(recipe, rig)} tokens: the failure log found a 2048 chunk "
            "\"quadrupled prefill iterations on single-request 50-90K contexts\"; a single "
            "user is better served by a larger chunk (docs/sources.md, Chunked prefill)")
    return found


def _model_problems(r: Recipe) -> list[str]:
    problems = []
    spec = r.speculative
    if spec is not None and spec.min_acceptance_length > 1 + spec.num_speculative_tokens:
        problems.append(
            f"speculative.min_acceptance_length {spec.min_acceptance_length:g}: a pass yields at "
            f"most 1 + num_speculative_tokens = {1 + spec.num_speculative_tokens} tokens; "
            f"allowed: 1..{1 + spec.num_speculative_tokens}")
    if spec is not None and spec.method == "draft_model" and r.draft is None:
        problems.append("speculative method draft_model needs a draft model")
    if r.draft is not None and (spec is None or spec.method != "draft_model"):
        problems.append("a draft model is used only with speculative method draft_model")
    if spec is not None and spec.method == "mtp":
        if spec.mtp_head is None:
            problems.append(
                "speculative.mtp_head: say how the checkpoint stores its MTP head (unquantised "
                "or quantised; model.safetensors.index.json shows weight vs weight_packed)"
            )
        elif spec.mtp_head == "quantised":
            problems.append(
                "speculative.mtp_head quantised: the failure log's INT4-quantised MTP head "
                "accepted only 1.07-1.27 tokens and bought nothing (56 vs 58 tok/s); use an "
                "unquantised (BF16) head or a draft model (docs/sources.md, MTP)"
            )
    elif spec is not None and spec.mtp_head is not None:
        problems.append("speculative.mtp_head is for method mtp")
    if r.engine != "llama.cpp" and r.model.file is not None:
        problems.append("model.file is for llama.cpp GGUF models")
    return problems


#: The only CUDA runtime GDN kernels build and load with (docs/sources.md, GDN models).
GDN_CUDA = "13.0"


def _gdn_problems(r: Recipe) -> list[str]:
    """The failure log's GDN traps that a recipe alone shows (docs/sources.md, GDN models)."""
    problems = []
    for arg in r.extra_args:
        flag = arg.split("=", 1)[0]
        if r.model.gdn and flag == "--enable-torch-compile":
            problems.append(
                "extra_args: --enable-torch-compile crashes on GDN models (the failure log; "
                "docs/sources.md, GDN models)"
            )
        if "extra_buffer" in arg:
            problems.append(
                "extra_args: the extra_buffer mamba radix-cache strategy took decode from 62 to "
                "30 tok/s (~52%) in the failure log, a permanent charge against a rare failure "
                "(docs/sources.md, GDN models); leave the engine's default"
            )
    return problems


def gdn_fit_problems(recipe: Recipe, rig: Rig) -> list[str]:
    """The GDN trap that needs the rig's host data: a venv whose CUDA is known (a shipped pin
    set) and is not 13.0. The card's own GDN limits are card_problems'."""
    if not any(pin.gdn for pin in recipe.models):
        return []
    problems = []
    venv = next((v for v in rig.venvs if v.name == recipe.venv), None)
    cuda = venv_cuda(venv.packages) if venv is not None else None
    if cuda is not None and cuda != GDN_CUDA:
        problems.append(
            f"venv {venv.name} resolves to CUDA {cuda}; GDN kernels need CUDA {GDN_CUDA} exactly "
            "(12.8 hangs on load, 13.3 fails to build: the failure log; docs/sources.md, "
            "GDN models)"
        )
    return problems


def venv_cuda(packages: tuple[str, ...]) -> str | None:
    """The CUDA runtime a venv's pins resolve to, where rigbook knows it: a shipped pin set
    (files/venvs/pins.toml `cuda`); None otherwise (the preflight reads the built manifest)."""
    for pins in engine_pins().values():
        if tuple(pins["packages"]) == tuple(packages):
            return pins.get("cuda")
    return None


def mtp_head_of_index(index: dict) -> Literal["unquantised", "quantised"] | None:
    """How a checkpoint stores its MTP head, from its model.safetensors.index.json: a tensor
    under an `mtp` module ending in `.weight_packed` means quantised (the failure log's
    half-quantised checkpoint), `.weight` only means unquantised; None: no MTP tensors."""
    names = [
        name for name in (index.get("weight_map") or {})
        if "mtp" in name.split(".")
    ]
    if any(name.endswith(".weight_packed") for name in names):
        return "quantised"
    if any(name.endswith(".weight") for name in names):
        return "unquantised"
    return None


#: The weight index of a sharded safetensors checkpoint (where the MTP head's storage shows).
WEIGHT_INDEX = "model.safetensors.index.json"


def mtp_index_problem(recipe: Recipe, index_text: str | None) -> str | None:
    """The served checkpoint's own index against the recipe's MTP declaration (None: fine, or
    nothing to check: no MTP, or no index in the snapshot)."""
    spec = recipe.speculative
    if spec is None or spec.method != "mtp" or not index_text:
        return None
    try:
        index = json.loads(index_text)
    except ValueError:
        return None
    head = mtp_head_of_index(index) if isinstance(index, dict) else None
    if head == "quantised":
        return (
            f"{WEIGHT_INDEX} stores the MTP head as weight_packed (quantised), though the recipe "
            "declares it unquantised: a quantised head accepted only 1.07-1.27 tokens in the "
            "failure log (docs/sources.md, MTP); use a checkpoint with a BF16 head or a draft "
            "model"
        )
    if head is None:
        return f"{WEIGHT_INDEX} lists no MTP tensors: the model has no MTP head to speculate with"
    return None


def mixed_linear_attention(index: dict) -> list[str]:
    """The linear-attention (GDN) projections a checkpoint stores both ways across its layers:
    `.weight_packed` (quantised) in some layers and plain `.weight` in others, the failure log's
    half-quantised checkpoint ("some linear-attention layers stored as plain `weight` rather than
    `weight_packed`"). A projection kept plain in every layer is a choice, not a mix."""
    kinds: dict[str, set[str]] = {}
    for name in index.get("weight_map") or {}:
        parts = name.split(".")
        if "linear_attn" not in parts or parts[-1] not in ("weight", "weight_packed"):
            continue
        at = parts.index("linear_attn")
        kinds.setdefault(".".join(parts[at:-1]), set()).add(parts[-1])
    return sorted(module for module, seen in kinds.items() if len(seen) == 2)


def gdn_index_problem(recipe: Recipe, index_text: str | None) -> str | None:
    """An SGLang recipe's GDN checkpoint whose linear-attention layers mix quantised and plain
    storage: SGLang hung loading such a checkpoint (the failure log; None: fine, or no index)."""
    if recipe.engine != "sglang" or not recipe.model.gdn or not index_text:
        return None
    try:
        index = json.loads(index_text)
    except ValueError:
        return None
    mixed = mixed_linear_attention(index) if isinstance(index, dict) else []
    if not mixed:
        return None
    return (f"{WEIGHT_INDEX} stores {', '.join(mixed)} as weight_packed in some layers and as "
            "plain weight in others: SGLang hung loading such a half-quantised checkpoint in the "
            "failure log, while the fully quantised one loaded (docs/sources.md, MTP); use a "
            "checkpoint quantised the same way in every layer")


def _env_problems(r: Recipe) -> list[str]:
    return env_problems(r.env, "env")


# --- the catalogue ---------------------------------------------------------------------------


def load_recipe(path: Path) -> Recipe:
    """One recipe file; RigbookError names the file and every bad field."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise RigbookError(f"{path}: {e}") from None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"{path}: {'.'.join(str(p) for p in e['loc']) or 'recipe'}: "
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        ]
        raise RigbookError("\n".join(lines)) from None
    if recipe.name != path.stem:
        raise RigbookError(f"{path}: name {recipe.name!r} must be the file's stem {path.stem!r}")
    return recipe


def catalogue(extra_dirs: tuple[str, ...] = ()) -> dict[str, Recipe]:
    """Every recipe by name: the shipped ones, then those in extra_dirs (no shadowing)."""
    recipes: dict[str, Recipe] = {}
    for folder in (RECIPES_DIR, *map(Path, extra_dirs)):
        if not folder.is_dir():
            raise RigbookError(f"serving_recipe_dirs: {folder} is not a directory")
        for path in sorted(folder.glob("*.toml")):
            recipe = load_recipe(path)
            if recipe.name in recipes:
                raise RigbookError(f"{path}: a recipe named {recipe.name!r} already exists")
            recipes[recipe.name] = recipe
    return recipes


def recipe_for(rig: Rig, rig_name: str) -> Recipe:
    """The rig's recipe (rig.recipe), checked against the rig; RigbookError if it does not fit."""
    recipes = catalogue(rig.serving_recipe_dirs)
    if rig.recipe not in recipes:
        raise RigbookError(
            f"{rig_name}: recipe: unknown recipe {rig.recipe!r}; allowed: {', '.join(recipes)}"
        )
    recipe = recipes[rig.recipe]
    problems = fit_problems(recipe, rig)
    if problems:
        raise RigbookError(
            f"{rig_name}: recipe {recipe.name} does not fit this rig:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return recipe


def fit_problems(recipe: Recipe, rig: Rig) -> list[str]:
    """Why a recipe does not fit a rig's host data (empty: it fits)."""
    fits, problems = recipe.fits, []
    if rig.platform not in fits.platforms:
        problems.append(f"platform is {rig.platform}; the recipe fits {', '.join(fits.platforms)}")
    venv = next((v for v in rig.venvs if v.name == recipe.venv), None)
    if venv is None:
        have = ", ".join(v.name for v in rig.venvs) or "none"
        problems.append(f"venv {recipe.venv!r} is not in the rig's venvs (it has: {have})")
    elif venv.engine != VENV_ENGINE[recipe.engine]:
        problems.append(f"venv {venv.name} is a {venv.engine} venv; the recipe is {recipe.engine}")
    problems += pattern_problems(recipe, rig)
    shm = shm_offload_problem(recipe, rig.shm_size)
    if shm is not None:
        problems.append(shm)
    if recipe.cpu_only:
        return problems
    if rig.gpu_class not in fits.gpu_class:
        problems.append(
            f"gpu_class is {rig.gpu_class}; the recipe fits {', '.join(fits.gpu_class)}"
        )
    if rig.gpu_count != fits.gpu_count:
        problems.append(f"gpu_count is {rig.gpu_count}; the recipe needs {fits.gpu_count}")
    if fits.nvlink == "required" and not rig.nvlink:
        problems.append("the recipe needs NVLink (nvlink: true)")
    if fits.nvlink == "forbidden" and rig.nvlink:
        problems.append("the recipe is for rigs without NVLink (this rig has nvlink: true)")
    problems += gdn_fit_problems(recipe, rig) + override_problems(recipe, rig)
    card = class_card(rig.gpu_class)
    if card is not None:
        problems += card_problems(recipe, rig, card)
    card = VRAM_GIB.get(rig.gpu_class)
    need = vram_need_gib(recipe, rig)
    if card is not None and need > card - VRAM_MARGIN_GIB:
        problems.append(f"weights and KV need {need:.1f} GiB per card; a {rig.gpu_class} has "
                        f"{card} GiB, {VRAM_MARGIN_GIB:g} GiB of it kept free (docs/sources.md, "
                        "VRAM margins)")
    return problems


#: VRAM kept free on every card, never handed to a model (the runbook's margin_mib = 1024;
#: docs/sources.md, VRAM margins): a driver, a compositor or a display live in it.
VRAM_MARGIN_GIB = 1.0


def vram_need_gib(recipe: Recipe, rig: Rig | None = None) -> float:
    """Per card: the weights and KV split over the cards, plus the per-card overhead. With a
    rig, the KV estimate scales with the rig's serving_max_model_len."""
    cards = recipe.tensor_parallel_size
    weights = sum(pin.weights_gib for pin in recipe.models)
    kv = recipe.estimate.kv_gib
    if rig is not None:
        kv *= min(max_model_len_of(recipe, rig) / recipe.max_model_len, 1.0)
    return (weights + kv) / cards + recipe.estimate.overhead_gib


def max_model_len_of(recipe: Recipe, rig: Rig) -> int:
    """The context served on this rig: serving_max_model_len, else the recipe's."""
    return rig.serving_max_model_len or recipe.max_model_len


def gpu_memory_utilization_of(recipe: Recipe, rig: Rig) -> float | None:
    """The share of each card claimed on this rig: serving_gpu_memory_utilization, else the
    recipe's (None: llama.cpp, which claims what it loads)."""
    if recipe.gpu_memory_utilization is None:
        return None
    return rig.serving_gpu_memory_utilization or recipe.gpu_memory_utilization


def override_problems(recipe: Recipe, rig: Rig) -> list[str]:
    """The rig's serving overrides against the recipe, and the VRAM margin on a known card."""
    problems = []
    if rig.serving_max_model_len is not None and rig.serving_max_model_len > recipe.max_model_len:
        problems.append(
            f"serving_max_model_len {rig.serving_max_model_len} is above the recipe's "
            f"{recipe.max_model_len}: it can only lower it (the recipe's memory estimate is for "
            "its own context)"
        )
    if rig.serving_gpu_memory_utilization is not None and recipe.gpu_memory_utilization is None:
        problems.append(f"serving_gpu_memory_utilization: {recipe.engine} has no such setting")
    card = VRAM_GIB.get(rig.gpu_class)
    share = gpu_memory_utilization_of(recipe, rig)
    if card is not None and share is not None and card - share * card < VRAM_MARGIN_GIB - 1e-9:
        problems.append(
            f"gpu_memory_utilization {share:g} of a {card} GiB {rig.gpu_class} leaves "
            f"{card - share * card:.2f} GiB; {VRAM_MARGIN_GIB:g} GiB per card is kept for the "
            "driver and display (docs/sources.md, VRAM margins)"
        )
    return problems



# --- rendering -------------------------------------------------------------------------------


#: A split GGUF's shard: NAME-00001-of-00003.gguf (llama.cpp loads the others beside it).
_GGUF_SHARD = re.compile(r"(.+)-\d{5}-of-(\d{5})\.gguf")


def gguf_patterns(file: str) -> tuple[str, ...]:
    """What a llama.cpp recipe needs of its repo: its GGUF file, or every shard of a split one
    (llama.cpp opens the first and reads the rest from beside it)."""
    shard = _GGUF_SHARD.fullmatch(file)
    return (f"{shard.group(1)}-*-of-{shard.group(2)}.gguf",) if shard else (file,)


def pin_hint(pin: ModelPin) -> str:
    """The `models` entry to add for a recipe's model, as the Python inventory writes it."""
    entry = f'{{"repo": "{pin.repo}", "revision": "<40-hex commit>"'
    if pin.file:
        entry += ", \"allow_patterns\": [" + ", ".join(
            f'"{p}"' for p in gguf_patterns(pin.file)) + "]"
    return (f"add {entry}}} to the rig's models (`rigbook models resolve {pin.repo}` prints the "
            "commit to pin, the files and sizes it pulls, and whether the repo is gated)")


def _recipe_files(rig: Rig) -> dict[str, tuple[str, ...]]:
    """repo -> the patterns of the GGUF file the rig's recipe serves from it."""
    try:
        recipe = catalogue(rig.serving_recipe_dirs).get(rig.recipe) if rig.recipe else None
    except RigbookError:
        return {}
    if recipe is None:
        return {}
    return {pin.repo: gguf_patterns(pin.file) for pin in recipe.models if pin.file}


def rig_models(rig: Rig) -> tuple[ModelSpec, ...]:
    """The rig's `models`, each entry for the repo of its llama.cpp recipe's GGUF narrowed to
    that file when it names no patterns: a GGUF repo holds every quantisation of the model, and
    the engine loads one."""
    files = _recipe_files(rig)
    return tuple(
        spec.model_copy(update={"allow_patterns": files[spec.repo]})
        if spec.repo in files and not (spec.allow_patterns or spec.ignore_patterns) else spec
        for spec in rig.models
    )


def pinned_revision(pin: ModelPin, rig: Rig, *, allow_placeholder: bool = False) -> str:
    """The commit served: the rig's `models` entry for the repo wins over the recipe's."""
    for spec in rig.models:
        if spec.repo == pin.repo:
            if spec.revision == PLACEHOLDER_REVISION and not allow_placeholder:
                raise RigbookError(placeholder_text(pin.repo))
            return spec.revision
    if pin.placeholder and not allow_placeholder:
        raise RigbookError(
            f"models: the recipe pins no real commit of {pin.repo} (placeholder revision); "
            + pin_hint(pin)
        )
    return pin.revision


def placeholder_text(repo: str) -> str:
    return (f"models: {repo} is pinned to the all-zeros placeholder, which is no commit; pin the "
            f"one `rigbook models resolve {repo}` prints")


def recipe_pins(recipe: Recipe, rig: Rig) -> tuple[ModelSpec, ...]:
    """The ModelSpecs the cache must hold for a recipe (the rig's entry for a repo wins, a
    GGUF's narrowed to its file: rig_models); RigbookError for a placeholder revision."""
    models = rig_models(rig)
    for pin in recipe.models:
        pinned_revision(pin, rig)
    return tuple(
        next((spec for spec in models if spec.repo == pin.repo), None)
        or ModelSpec(repo=pin.repo, revision=pin.revision)
        for pin in recipe.models
    )


def pattern_problems(recipe: Recipe, rig: Rig) -> list[str]:
    """A rig's allow/ignore patterns for a GGUF recipe's repo that leave its file out."""
    problems = []
    for pin in recipe.models:
        spec = next((s for s in rig.models if s.repo == pin.repo), None)
        if pin.file is None or spec is None:
            continue
        allowed = not spec.allow_patterns or any(
            fnmatch.fnmatch(pin.file, p) for p in spec.allow_patterns)
        if not allowed or any(fnmatch.fnmatch(pin.file, p) for p in spec.ignore_patterns):
            problems.append(
                f"models: the patterns of {pin.repo} leave out {pin.file}, the file the recipe "
                f"serves; allowed: \"allow_patterns\": {list(gguf_patterns(pin.file))} "
                "(or no patterns: rigbook then pulls that file only)")
    return problems


def model_path(pin: ModelPin, rig: Rig, *, allow_placeholder: bool = False) -> str:
    """What the engine loads: the snapshot folder, or the GGUF file inside it."""
    folder = snapshot_dir(
        rig.models_cache, pin.repo, pinned_revision(pin, rig, allow_placeholder=allow_placeholder)
    )
    return f"{folder}/{pin.file}" if pin.file else folder


def bind_of(recipe: Recipe, rig: Rig) -> str:
    return rig.serving_bind or recipe.bind


def port_of(recipe: Recipe, rig: Rig) -> int:
    return rig.serving_port or recipe.port


def is_loopback(bind: str) -> bool:
    return ipaddress.ip_address(bind).is_loopback


def engine_argv(recipe: Recipe, rig: Rig, *, allow_placeholder: bool = False) -> list[str]:
    """The exact command line the serving unit runs for this recipe on this rig.

    The API key is never in it: the unit passes it in the environment (VLLM_API_KEY for vLLM,
    API_KEY for llama-cpp-python's server).
    """
    venv = f"{venv_link(recipe.venv)}/bin"
    path = model_path(recipe.model, rig, allow_placeholder=allow_placeholder)
    host, port = bind_of(recipe, rig), str(port_of(recipe, rig))
    if recipe.engine == "vllm":
        argv = [
            f"{venv}/vllm", "serve", path,
            "--served-model-name", recipe.served_name(),
            "--host", host, "--port", port,
            "--tensor-parallel-size", str(recipe.tensor_parallel_size),
            "--max-model-len", str(max_model_len_of(recipe, rig)),
            "--gpu-memory-utilization", f"{gpu_memory_utilization_of(recipe, rig):g}",
        ]
        if recipe.kv_cache_dtype is not None:
            argv += ["--kv-cache-dtype", recipe.kv_cache_dtype]
        if recipe.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(recipe.max_num_seqs)]
        if recipe.chunked_prefill:
            argv += ["--enable-chunked-prefill"]
        if recipe.max_num_batched_tokens is not None:
            argv += ["--max-num-batched-tokens", str(recipe.max_num_batched_tokens)]
        if recipe.speculative is not None:
            argv += ["--speculative-config", _speculative_json(recipe, rig, allow_placeholder)]
        argv += ["--shutdown-timeout", str(VLLM_SHUTDOWN_TIMEOUT_S)]
        if recipe.tool_parser is not None:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", recipe.tool_parser]
        if recipe.reasoning_parser is not None:
            argv += ["--reasoning-parser", recipe.reasoning_parser]
    elif recipe.engine == "sglang":
        argv = [
            f"{venv}/python", "-m", "sglang.launch_server", "--model-path", path,
            "--host", host, "--port", port,
            "--tp", str(recipe.tensor_parallel_size),
            "--context-length", str(max_model_len_of(recipe, rig)),
            "--mem-fraction-static", f"{gpu_memory_utilization_of(recipe, rig):g}",
        ]
        if recipe.kv_cache_dtype is not None:
            argv += ["--kv-cache-dtype", recipe.kv_cache_dtype]
        if recipe.tool_parser is not None:
            argv += ["--tool-call-parser", recipe.tool_parser]
        if recipe.reasoning_parser is not None:
            argv += ["--reasoning-parser", recipe.reasoning_parser]
    else:
        argv = [
            f"{venv}/python", "-m", "llama_cpp.server", "--model", path,
            "--model_alias", recipe.served_name(),
            "--host", host, "--port", port,
            "--n_ctx", str(max_model_len_of(recipe, rig)),
            "--n_gpu_layers", "0" if recipe.cpu_only else "-1",
        ]
        if recipe.tool_parser is not None:
            argv += ["--chat_format", recipe.tool_parser]
    return argv + list(recipe.extra_args)


def _speculative_json(recipe: Recipe, rig: Rig, allow_placeholder: bool) -> str:
    spec = recipe.speculative
    config: dict[str, object] = {}
    if spec.method == "draft_model":
        config["model"] = model_path(recipe.draft, rig, allow_placeholder=allow_placeholder)
    config["num_speculative_tokens"] = spec.num_speculative_tokens
    config["method"] = spec.method
    return json.dumps(config, separators=(",", ":"))


def api_key_variable(recipe: Recipe) -> str | None:
    """The environment variable the engine reads its API key from (None: no verified one)."""
    return {"vllm": "VLLM_API_KEY", "llama.cpp": "API_KEY"}.get(recipe.engine)


# --- docs ------------------------------------------------------------------------------------

_DOC_INTRO = """\
# Serving recipes

<!-- Generated by `rigbook docs` from files/recipes/*.toml (roles/recipes.py); do not edit. -->

A recipe is a model + engine + flags + environment known to work on a class of rig. A rig
names one in its host data (`recipe: NAME`); `deploys/rig.py` and `deploys/serve.py` run it as
the `rigbook-serve` systemd unit (docs/serving.md). Each command line below is rendered for a
rig the recipe fits, with the default bind and port; the unit runs exactly this.

Revisions shown as `{placeholder}` are placeholders: no real commit is pinned in the catalogue,
so a rig must pin the repo in its `models` host data (`{{"repo": "ORG/NAME", "revision": "<40
hex>"}}`; `rigbook models resolve ORG/NAME` prints the commit, the files and sizes the pin pulls,
and whether the repo is gated: docs/models.md); the rig's pin always wins over the recipe's, and
the models role pulls exactly that commit. For a llama.cpp recipe the pull is its GGUF file only
(every shard of a split one), not every quantisation the repo holds, unless the rig's entry names
its own `allow_patterns`.

Words such as TP, SM86, GDN, MTP and Cliff 2 are in the [glossary](glossary.md).

The recipes a source measured come first: their model, flags, context, KV type and memory
share are that source's configuration, and the figures they quote were measured on it
(docs/sources.md). Each says which engine build the source ran (`measured_on.build`): where
that is not the build the recipe installs, its figures are the source's, not a promise of what
rigbook's build serves (their `figures` row says so). The generic recipes that follow serve
other models with the settings the sources give for the hardware, and quote no figure.
"""


#: The recipe to start with, per card class the docs name: (gpu_class, gpu_count, platforms,
#: recipe). tests/test_recipes.py checks that each fits such a rig.
START_WITH: tuple[tuple[GpuClass, int, tuple[Platform, ...], str], ...] = (
    ("rtx3090", 2, ("ubuntu", "debian"), "qwen36-27b-dual-3090"),
    ("rtx3090", 2, ("wsl2",), "wsl2-dual-3090-tp2"),
    ("rtx3090", 1, ("ubuntu", "debian", "wsl2"), "qwen36-27b-llamacpp"),
    ("rtx3090ti", 2, ("ubuntu", "debian"), "qwen36-27b-dual-3090"),
    ("rtx3090ti", 1, ("ubuntu", "debian", "wsl2"), "llamacpp-single"),
    ("rtx4090", 1, ("ubuntu", "debian", "wsl2"), "qwen36-27b-llamacpp"),
    ("rtx5090", 1, ("ubuntu", "debian", "wsl2"), "qwen36-27b-5090"),
    ("a5000", 1, ("ubuntu", "debian", "wsl2"), "llamacpp-single"),
    ("a6000", 1, ("ubuntu", "debian", "wsl2"), "llamacpp-single"),
    ("other", 2, ("ubuntu", "debian"), "qwen36-27b-dual-20g"),
)


def _start_with_lines(recipes: dict[str, Recipe]) -> list[str]:
    lines = [
        "## Which recipe to start with\n",
        "One line per card class: the recipe that serves the sources' model (Qwen3.6-27B) where "
        "one fits, else a generic one. `other` is for cards rigbook has no class for (two "
        "modded 20 GB RTX 3080s); a card it knows, declared `other`, is refused by the "
        "preflight (the rig's nvidia-smi names it).\n",
        "| cards | platforms | start with | measured |", "| --- | --- | --- | --- |",
    ]
    for gpu_class, count, platforms, name in START_WITH:
        recipe = recipes[name]
        measured = ("no: quotes no figure" if not recipe.measured else
                    "yes, on this build" if measured_on_its_build(recipe) else
                    "yes, on another engine build: the figures are the source's")
        lines.append(f"| {count}x {gpu_class} | {', '.join(platforms)} | [`{name}`](#{name}) "
                     f"| {measured} |")
    return lines + [""]


def example_rig(recipe: Recipe) -> Rig:
    """A rig the recipe fits (for the docs and the catalogue tests)."""
    fits = recipe.fits
    venv = engine_venv(VENV_ENGINE[recipe.engine], name=recipe.venv)
    data = {
        "platform": fits.platforms[0],
        "gpu_class": fits.gpu_class[0] if fits.gpu_class else "rtx3090",
        "gpu_count": fits.gpu_count or 1,
        "nvlink": fits.nvlink == "required",
        "power_profile": "stock",
        "venvs": [venv],
        "recipe": recipe.name,
    }
    if data["gpu_class"] == "other":
        data["gpu_limits_watts"] = (100, 320)
    return Rig.model_validate(data)


def _recipe_section(recipe: Recipe) -> list[str]:
    rig = example_rig(recipe)
    fits = recipe.fits
    lines = [f"## `{recipe.name}`\n", recipe.description.strip() + "\n"]
    follows = "; ".join(ref.markdown() for ref in recipe.sources) or (
        "rigbook's own configuration: no source document"
    )
    rows = [
        ("engine", f"{recipe.engine} (venv `{recipe.venv}`)"),
        ("follows", follows),
        ("fits", _fits_text(recipe)),
    ]
    for label, pin in (("model", recipe.model), ("draft", recipe.draft)):
        if pin is not None:
            rev = "placeholder" if pin.placeholder else f"`{pin.revision}`"
            file = f", file `{pin.file}`" if pin.file else ""
            rows.append((label, f"`{pin.repo}` at {rev}{file}, ~{pin.weights_gib:g} GiB"))
    figures = figures_text(recipe)
    if figures:
        rows.append(("figures", figures))
    est = recipe.estimate
    rows.append((
        "estimate",
        f"KV {est.kv_gib:g} GiB, {est.overhead_gib:g} GiB per card overhead, "
        f"host RAM {est.host_ram_gib:g} GiB",
    ))
    env = {**recipe.env, **serving_environment(rig)}
    if env:
        rows.append(("environment", ", ".join(f"`{k}={v}`" for k, v in env.items())))
    lines += ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), ""]
    argv = engine_argv(recipe, rig, allow_placeholder=True)
    lines += [
        f"Command line ({fits.platforms[0]}, {rig.gpu_count}x {rig.gpu_class}):\n",
        "    " + " \\\n        ".join(_command_lines(argv)),
        "",
    ]
    return lines


def _configuration(recipe: Recipe) -> str:
    if not recipe.measured:
        return "generic: quotes no figure"
    if measured_on_its_build(recipe):
        return "measured by its source, on this build"
    return f"measured by its source on {recipe.measured_on.build}, not on this build"


def _fits_text(recipe: Recipe) -> str:
    fits = recipe.fits
    if recipe.cpu_only:
        return f"CPU only; {', '.join(fits.platforms)}"
    nvlink = {"required": "NVLink required", "forbidden": "no NVLink", "any": "NVLink or not"}
    return (
        f"{fits.gpu_count}x {' / '.join(fits.gpu_class)}, {nvlink[fits.nvlink]}, "
        f"{', '.join(fits.platforms)}"
    )


def _command_lines(argv: list[str]) -> list[str]:
    """Shell words, a new line at each --option (its value stays with it)."""
    lines: list[str] = []
    for arg in argv:
        if lines and not arg.startswith("--"):
            lines[-1] += " " + _shell_word(arg)
        else:
            lines.append(_shell_word(arg))
    return lines


def _shell_word(arg: str) -> str:
    return arg if re.match(r"^[\w@%+=:,./-]+$", arg) else "'" + arg.replace("'", "'\\''") + "'"


def _schema_table(model: type[BaseModel], prefix: str = "") -> list[str]:
    lines = []
    for name, field in model.model_fields.items():
        lines.append(f"| `{prefix}{name}` | {field.description or ''} |")
    return lines


def recipes_markdown() -> str:
    """The whole docs/recipes.md text."""
    recipes = sorted(catalogue().values(), key=lambda r: not r.measured)  # stable: by name
    parts = [_DOC_INTRO.format(placeholder=PLACEHOLDER_REVISION[:8] + "...")]
    parts += _start_with_lines({r.name: r for r in recipes}) + ["## Catalogue\n"]
    parts += ["| recipe | engine | fits | configuration |", "| --- | --- | --- | --- |"]
    parts += [f"| `{r.name}` | {r.engine} | {_fits_text(r)} | {_configuration(r)} |"
              for r in recipes]
    parts.append("")
    for recipe in recipes:
        parts += _recipe_section(recipe)
    parts += ["## Recipe file keys\n", "| key | meaning |", "| --- | --- |"]
    parts += _schema_table(Recipe)
    for key, model in (
        ("sources[].", SourceRef), ("model.", ModelPin), ("speculative.", Speculative),
        ("fits.", Fits), ("measured_on.", MeasuredOn), ("estimate.", Estimate),
    ):
        parts += _schema_table(model, key)
    return "\n".join(parts) + "\n"


# --- rules keyed on the card (rigbook.core.cards) -----------------------------------------------


def _selected(recipe: Recipe) -> list[str]:
    """Every word a recipe passes to its engine: extra_args items and env KEY=value pairs."""
    return [*recipe.extra_args, *(f"{key}={value}" for key, value in recipe.env.items())]


def card_problems(recipe: Recipe, rig: Rig, card: Card) -> list[str]:
    """Why the recipe cannot serve on this card (empty: nothing the card refuses)."""
    if recipe.cpu_only:
        return []
    problems = []
    gdn = any(pin.gdn for pin in recipe.models)
    words = _selected(recipe)
    if gdn and card.compute_cap < SM90 and any("flashinfer" in w.lower() for w in words):
        problems.append(
            f"extra_args or env select FlashInfer, whose GDN kernels need SM90+; this card is "
            f"{card.sm} ({card.seen}), where only the Triton linear-attention backend runs (the "
            "failure log; docs/sources.md, Rules keyed on the card)")
    if card.compute_cap[0] != SM90[0]:
        for word, kernel in SM90_KERNELS.items():
            if any(word in w.upper() for w in words):
                problems.append(
                    f"{kernel} is built for SM90 (Hopper); this card is {card.sm} ({card.seen}), "
                    "where kernels shipped for SM90 fail to select or assert (the runbook; "
                    "docs/sources.md, Rules keyed on the card)")
    context = max_model_len_of(recipe, rig)
    if (gdn and recipe.engine != "llama.cpp" and recipe.tensor_parallel_size == 1
            and card.vram_gib <= CLIFF2_VRAM_GIB and context > CLIFF2_MAX_CONTEXT):
        problems.append(
            f"max_model_len {context} on one {card.vram_gib:g} GiB card ({card.seen}): 24 GB "
            "single-card configs take the chunked-prefill path where a GDN model's single "
            "prompts past ~50K may OOM (Cliff 2; docs/sources.md, Rules keyed on the card); set "
            f"serving_max_model_len <= {CLIFF2_MAX_CONTEXT}, split over two cards (TP=2), or "
            "use llama.cpp")
    return problems


def card_warnings(recipe: Recipe, rig: Rig, card: Card) -> list[str]:
    """What the card costs the recipe, short of refusing it."""
    context = max_model_len_of(recipe, rig)
    if (recipe.cpu_only or recipe.engine == "llama.cpp" or card.compute_cap != SM86
            or context <= SM86_LONG_CONTEXT):
        return []
    return [f"max_model_len {context} on {card.sm} ({card.seen}): single-stream decode on SM86 "
            "slows ~71% from 0 to 131K context, \"architectural, not model-specific\"; the "
            f"hardware notes switch to llama.cpp past ~{SM86_LONG_CONTEXT // 1000}K "
            "(docs/sources.md, Long context on SM86)"]
