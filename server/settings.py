"""Server settings: one pydantic-settings class, read from CELLSERVE_* env vars and CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler.speculative import parse_spec_type


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CELLSERVE_", extra="ignore")

    model: str | None = None  # GGUF file or HF folder; None = the embedded SmolLM2
    # many models in one server (server/model_router.py, llama.cpp's router mode): every GGUF
    # file and HF folder in models_dir, and each "NAME=PATH" in models; a request's `model`
    # picks one, loaded on first use; at most models_max stay loaded (LRU idle one unloaded)
    models_dir: str | None = None
    models: list[str] = Field(default_factory=list)
    models_max: int = Field(4, ge=1)
    models_autoload: bool = True  # off: only POST /models/load loads a model
    chat_template: str | None = None  # Jinja file or string; None = the model's own
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    n_cells: int = Field(8192, ge=16)
    n_seq_max: int = Field(32, ge=1)
    n_batch: int = Field(512, ge=1)  # llama.cpp's n_ubatch; 256 cost ~15% at c=32 (bench)
    ctx_per_seq: int = Field(2048, ge=8)
    context_shift: bool = True
    prefix_cache: bool = True
    # full-attention models: finished conversations past the n_seq_max holders stay in a radix
    # index over held cells (scheduler/radix.py); off: only the holders are remembered
    prefix_index: bool = True
    # models with sliding-window layers (iSWA): cells each window pool gets for the windows of
    # the conversations the prefix index keeps (None: n_cells // 4; 0: only the holders)
    swa_index_cells: int | None = Field(None, ge=0)
    # positions per virtual block of a cached prompt (server.cache_config): the block_size of
    # vllm:cache_config_info; must equal the router's block size (llm-d's guides use 64)
    kv_events_block_size: int = Field(16, ge=1, le=4096)
    # KV events (server/kv_events.py): off unless an endpoint is given (here or in the JSON)
    kv_events_endpoint: str | None = None
    kv_events_topic: str | None = None  # None: kv@<host>:<port>@<model> (array), "" (map)
    kv_events_replay_endpoint: str | None = None
    kv_events_encoding: Literal["array", "map"] = "array"
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON
    # llama.cpp's slot save/restore (server/routes_slots.py): files live in this folder only;
    # None: save and restore answer 501 (erase works without it)
    slot_save_path: str | None = None
    # the prefix cache's second tier (scheduler/cache_tier.py): finished prompts of at least
    # cache_tier_min_tokens are copied to host RAM (MiB; 0: off) and/or a folder that survives
    # restarts (at most cache_dir_max_mib), and come back on a prefix match
    cache_ram: int = Field(0, ge=0)
    cache_dir: str | None = None
    cache_dir_max_mib: int = Field(10240, ge=1)
    cache_tier_min_tokens: int = Field(64, ge=1)
    # recurrent / hybrid models: state slots kept for prefix-cache checkpoints beside one per
    # sequence id (None: n_seq_max), and the positions between a prompt's checkpoints
    state_checkpoints: int | None = Field(None, ge=0)
    state_checkpoint_interval: int = Field(256, ge=1)
    # speculative decoding (scheduler/speculative.py): "ngram" drafts by prompt lookup
    # (llama.cpp's ngram-simple), "draft" with model_draft (implied by it), "ngram,draft"
    # both, the lookup first (llama.cpp's comma-separated list); none = off
    spec_type: str | None = None
    model_draft: str | None = None  # a GGUF file or HF folder with the target's tokenizer
    draft_max: int = Field(16, ge=0, le=256)  # tokens one sequence drafts per step at most
    draft_min: int = Field(0, ge=0, le=256)  # shorter proposals are not verified
    # the draft model's output head over token ids below this only (a reduced draft vocabulary:
    # its drafts never propose a higher id); 0: its whole vocabulary
    draft_vocab: int = Field(0, ge=0)
    # None: the fast setup for this machine (model.load.loader.choose_runtime): bfloat16 where the
    # CPU computes it natively, else float32; a quantized GGUF served int4 / int8 on CPU.
    # --quant none --dtype float32 is the reference (the logits of the unquantized model).
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # how K and V rows are stored (kvcache/cache_types.py, llama.cpp's names); None: 16-bit,
    # bf16 where the CPU has AVX-512 BF16 (native bfloat16 dot products), else f16 (F16C)
    cache_type_k: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] | None = None
    cache_type_v: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] | None = None
    device: Literal["cpu", "cuda", "auto"] = "auto"
    # weight-only, CPU; int8/int4 re-quantize (changes the logits), gguf: the file's own blocks
    quant: Literal["none", "int8", "int4", "gguf"] | None = None
    # None = every core (model.runner.worker.set_torch_threads)
    threads: int | None = Field(None, ge=1)
    api_key: SecretStr | None = None
    served_model_name: str | None = None
    # LoRA adapters (server/lora.py): PEFT folders or GGUF LoRAs, "PATH" or "NAME=PATH", at
    # global scale 1 (--lora) or their own (--lora-scaled); 0 for all with lora_init_without_apply
    lora: list[str] = Field(default_factory=list)
    lora_scaled: list[tuple[str, float]] = Field(default_factory=list)
    lora_init_without_apply: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (server/lora_runtime.py); also on
    # with vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true
    allow_runtime_lora: bool = Field(
        False,
        validation_alias=AliasChoices(
            "allow_runtime_lora", "CELLSERVE_ALLOW_RUNTIME_LORA", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
        ),
    )
    max_queue: int = Field(256, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)
    max_n: int = Field(8, ge=1)
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    request_timeout: float = Field(600.0, gt=0)
    stream_buffer: int = Field(1024, ge=1)  # unsent tokens before a slow reader is cut off
    batch_invariant: bool = False  # a sequence's logits do not depend on the rest of its batch
    drain_timeout: float = Field(30.0, ge=0)
    drain_grace: float = Field(0.0, ge=0)  # after SIGTERM: /health 503, new requests still served
    protect_metrics: bool = False
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_prompts: bool = False  # prompts are never logged unless this is on
    cors_allow_origins: str = ""  # comma-separated origins (or "*"); "" = no CORS headers

    @model_validator(mode="after")
    def _spec_type(self) -> Settings:
        if self.spec_type is not None:
            parse_spec_type(self.spec_type, bool(self.model_draft))  # ValueError: unknown
        return self

    @model_validator(mode="after")
    def _router_flags(self) -> Settings:
        if not self.router_mode:
            return self
        clash = [
            flag
            for flag, given in (
                ("--served-model-name", self.served_model_name),
                ("--lora", self.lora or self.lora_scaled),
                ("--allow-runtime-lora", self.allow_runtime_lora),
                ("--kv-events-endpoint", self.kv_events_endpoint or self.kv_events_config),
            )
            if given
        ]
        if clash:
            flags = ", ".join(clash)
            raise ValueError(f"{flags}: not supported with several models (--models-dir)")
        return self

    @property
    def router_mode(self) -> bool:
        """Several models (--models-dir, --model NAME=PATH): server/model_router.py."""
        return bool(self.models_dir or self.models)

    @property
    def spec_kind(self) -> str:
        """The speculation type in effect: a draft model adds "draft" (unless the type says
        none), so `--spec-type ngram --model-draft X` is both, the lookup first."""
        if self.spec_type is None:
            return "draft" if self.model_draft else "none"
        return parse_spec_type(self.spec_type, bool(self.model_draft))

    @property
    def lora_specs(self) -> list[tuple[str | None, str, float]]:
        """(name or None, path, global scale) of each adapter, --lora ones first (their ids)."""
        off = self.lora_init_without_apply
        out = []
        for spec, scale in [(p, 1.0) for p in self.lora] + list(self.lora_scaled):
            name, sep, path = spec.partition("=")
            if not sep or Path(spec).exists():
                name, path = "", spec
            out.append((name or None, path, 0.0 if off else scale))
        return out

    @property
    def cors_origins(self) -> list[str]:
        return [o.strip() for o in self.cors_allow_origins.split(",") if o.strip()]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
