"""What the routes serve from: the engine client plus the model's tokenizer and chat template."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.stats import StepStats
from server.engine_client import EngineClient

if TYPE_CHECKING:
    from model.load.matryoshka import Matryoshka
    from model.runner.grammar import GrammarCompiler
    from server.lora import LoraAdapters
    from server.lora_runtime import LoraRuntime
from server.settings import Settings


class Tokenizer(Protocol):
    bos_id: int | None
    eos_ids: Any
    vocab_size: int

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """parse_special=False: special tokens' spellings in `text` stay text."""
        ...

    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


class ChatTemplate(Protocol):
    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """kwargs: `tools` and chat_template_kwargs, when the request has them."""
        ...


@dataclass(slots=True)
class Backend:
    engine: EngineClient
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # None: the model has none; chat requests get 400
    model_name: str
    n_ctx_seq: int
    n_cells: int
    cache_bytes: int
    cache_bytes_per_cell: int = 0  # K and V of one token, every layer, as stored
    state_bytes: int = 0  # the recurrent state slots (conv + SSM of every recurrent layer)
    # (address, bytes) of the K/V and of the state slots' tensors in process memory: their
    # resident pages (server/process_memory.py); None: not in process memory (a GPU)
    cache_ranges: Callable[[], tuple[list[tuple[int, int]], list[tuple[int, int]]]] | None = None
    embedding_dim: int = 0  # length of an /v1/embeddings vector (the model's hidden size)
    # "embed": an encoder embedding model, served on /v1/embeddings only (the generation
    # endpoints answer 400); "generate": a generative model (its /v1/embeddings pools too)
    task: str = "generate"
    embedding_normalize: bool = True  # L2-normalise /v1/embeddings vectors
    # the shortened vectors the model was trained for (/v1/embeddings `dimensions`); None: none
    embedding_matryoshka: Matryoshka | None = None
    grammars: GrammarCompiler | None = None  # structured outputs; None: refused with a 400
    # what the model runs with (ISA path, kernels, dtype, quant): /metrics cellserve_runtime_info
    runtime: dict[str, str] = field(default_factory=dict)
    # weights mapped from the model file / held in process memory (/metrics cellserve_memory_bytes)
    weights_mapped_bytes: int = 0
    weights_owned_bytes: int = 0
    # per MoE layer, the rows each expert took (/metrics cellserve_moe_expert_rows); None: dense
    expert_load: Callable[[], list[list[int]]] | None = None
    # the model file's identity (model.load.fingerprint): slot files of another model are refused
    model_fingerprint: str = ""
    loras: LoraAdapters | None = None  # --lora adapters (server/lora.py); None: none
    lora_runtime: LoraRuntime | None = None  # --allow-runtime-lora (server/lora_runtime.py)


BackendFactory = Callable[[Settings, Callable[[StepStats], None]], Backend]
