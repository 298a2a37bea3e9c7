"""Which layers each model chunk builds, for any PRT placement and per-stage layer counts.

megatron-core asks its layer layout two questions while building a chunk: how many decoder
layers (``get_num_layers_to_build``) and the global index of the first (``get_layer_offset``,
which numbers ``layer_number`` and so the checkpoint keys). Its own answers assume the
``loop`` order. :class:`ReuseLayout` answers from the placement instead, so ``wave`` chunks,
``bi`` replica chunks and uneven stages get the layers (and layer numbers) of the same model
without pipelining. ``pre_process`` / ``post_process`` likewise come from the placement
(:func:`chunk_roles`): with ``wave`` and even R the last stage sits on rank 0, not rank P-1.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from .config import ReuseConfig


@dataclass(frozen=True)
class ChunkRole:
    """Model chunk ``chunk`` of ``rank``: it runs ``stage`` (a plan stage id), which computes
    model stage ``model_stage`` (layers ``first_layer .. first_layer + num_layers - 1``)."""

    rank: int
    chunk: int
    stage: int
    model_stage: int
    first_layer: int
    num_layers: int
    pre_process: bool
    post_process: bool


def chunk_roles(reuse: ReuseConfig, rank: int) -> list[ChunkRole]:
    """The chunks of ``rank`` in chunk order (the order of megatron's model list)."""
    placement = reuse.placement
    counts = reuse.layers_per_stage()
    roles = []
    for chunk, stage in enumerate(placement.rank_stages[rank]):
        k = placement.model_stage(stage)
        roles.append(
            ChunkRole(
                rank=rank,
                chunk=chunk,
                stage=stage,
                model_stage=k,
                first_layer=reuse.layer_offset(k),
                num_layers=counts[k],
                pre_process=k == 0,
                post_process=k == placement.depth - 1,
            )
        )
    return roles


def layout_problem(config) -> str | None:
    """Why ``config`` (a TransformerConfig, or None: nothing to check) cannot build PRT
    chunks: its layer layout is not a :class:`ReuseLayout`."""
    if not hasattr(config, "pipeline_model_parallel_layout") or isinstance(
        config.pipeline_model_parallel_layout, ReuseLayout
    ):
        return None
    return (
        "without the PRT layer layout: build its TransformerConfig with "
        "**megatron_prt.megatron.transformer_config_kwargs(reuse) (or the chunks with "
        "megatron_prt.megatron.model_provider)"
    )


def built_problem(module, role: ChunkRole) -> str | None:
    """Why ``module`` (an unwrapped chunk) is not the chunk ``role`` describes, or None.
    A chunk built from megatron's own flags instead (pipeline and virtual sizes set by
    hand, pre/post from ``is_pipeline_first_stage``) trains without an error as another
    model: wave runs its layers out of order, bi drops half of them. Checks what the
    module exposes: the config's layout, ``pre_process``/``post_process``, the layer
    numbers of its decoder (BertModel: encoder; megatron numbers from 1)."""
    where = (
        f"rank {role.rank}'s chunk {role.chunk} (stage {role.stage}, model stage "
        f"{role.model_stage})"
    )
    problem = layout_problem(getattr(module, "config", None))
    if problem is not None:
        return f"{where} was built {problem}"
    for name in ("pre_process", "post_process"):
        built = getattr(module, name, None)
        if built is not None and bool(built) != getattr(role, name):
            return (
                f"{where} was built with {name}={built}, its stage needs "
                f"{name}={getattr(role, name)}: take pre_process/post_process from "
                "megatron_prt.megatron.layout.chunk_roles(reuse, rank)[chunk], not from megatron's "
                "is_pipeline_first_stage/is_pipeline_last_stage"
            )
    block = getattr(module, "decoder", None)  # GPTModel's; BertModel's is its encoder
    block = getattr(module, "encoder", None) if block is None else block
    layers = getattr(block, "layers", None)
    numbers = [getattr(layer, "layer_number", None) for layer in layers or ()]
    want = list(range(role.first_layer + 1, role.first_layer + role.num_layers + 1))
    if layers is not None and None not in numbers and numbers != want:
        return (
            f"{where} holds layers {numbers}, its stage computes layers {want}: build its "
            "config with transformer_config_kwargs of this reuse configuration"
        )
    return None


class ReuseLayout(PipelineParallelLayerLayout):
    """megatron-core layer layout of a PRT placement (pass as
    ``TransformerConfig.pipeline_model_parallel_layout``; the config keeps an instance as is).

    ``layout[rank][chunk]`` lists the chunk's layer types as megatron's does; offsets come from
    the model stage, so a ``bi`` replica chunk numbers its layers like the stage it copies.
    """

    def __init__(self, reuse: ReuseConfig) -> None:
        placement = reuse.placement
        by_rank = [chunk_roles(reuse, rank) for rank in range(placement.ranks)]
        flat = []  # megatron's flat order: chunk-major, then rank
        for chunk in range(placement.chunks_per_rank):
            for rank in range(placement.ranks):
                role = by_rank[rank][chunk]
                flat.append(
                    ["embedding"] * role.pre_process
                    + ["decoder"] * role.num_layers
                    + ["loss"] * role.post_process
                )
        super().__init__(flat, placement.ranks)
        self.reuse = reuse
        self.roles = by_rank
        self.input_data = f"megatron-prt {placement} layers {reuse.layers_per_stage()}"

    def role(self, vp_stage: int | None, pp_rank: int | None) -> ChunkRole:
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        return self.roles[pp_rank][vp_stage or 0]

    def get_layer_offset(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None) -> int:
        if layer_type != LayerType.decoder:
            return 0
        return self.role(vp_stage, pp_rank).first_layer

    def validate_layer_layout(self, num_layers: int, mtp_num_layers) -> bool:
        """megatron's check counts every chunk's layers; ``bi`` replicas count twice, so
        check the model stages instead. Returns megatron's ``mtp_standalone`` (always False)."""
        if mtp_num_layers:
            raise ValueError("megatron-prt does not support multi-token prediction layers")
        if sum(self.reuse.layers_per_stage()) != num_layers:
            raise ValueError(
                f"the PRT layout holds {sum(self.reuse.layers_per_stage())} layers, the "
                f"model config {num_layers}"
            )
        return False
