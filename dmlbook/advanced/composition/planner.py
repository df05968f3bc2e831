"""What each layout costs: memory and bytes per rank, predicted, and layouts ranked (chapter 13).

For a char-GPT :class:`Workload` and a :class:`~dmlbook.advanced.composition.layout.Layout`, this
module predicts, for any rank, what :func:`~dmlbook.advanced.composition.training.train_composed`
measures:

* :func:`predict_memory`: parameters, gradients and AdamW state (exact: the shapes of the shards
  and ZeRO-1's whole-parameter partition, :func:`~dmlbook.advanced.zero.sharded_optimizer.
  partition_parameters`) and activations (an approximation: the tensors each layer saves, times
  the micro-batches 1F1B keeps alive on the stage, ``min(pp - stage, microbatches)``);
* :func:`predict_traffic`: for each dimension, the bytes this rank sends in one step and the
  messages on its critical path, collective by collective: a ring all-gather or reduce-scatter
  over n ranks sends (n - 1) / n of the whole tensor, a ring all-reduce twice that (chapter 2);
  expert parallelism assumes the router spreads tokens evenly (measured traffic shows how far
  it does not).

:func:`step_time` turns the traffic into seconds with chapter 2's alpha-beta model on a
**two-level network** (:class:`Network`: a fast link between the ranks of one node, a slow one
between nodes; a group that spans nodes runs at the slow link), adds the compute (FLOPs at a
rate, the 1F1B bubble included), and :func:`rank_layouts` lists every layout of a world size
that fits the model, cheapest first. The model is a guide, not a promise: the chapter sets its
ranking beside step times measured on the network lab.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from dmlbook.advanced.composition.layout import DEGREE_AXES, Axis, Layout
from dmlbook.advanced.context_parallel.styles import cp_chunks
from dmlbook.advanced.expert_parallel.moe import MoEFeedForward
from dmlbook.advanced.zero.sharded_optimizer import partition_parameters
from dmlbook.comm.costmodel import Link
from dmlbook.model_parallel.memory.spec import ADAM_STEP_BYTES, INDEX_BYTES
from dmlbook.model_parallel.pipeline import even_partition

__all__ = [
    "Network",
    "Workload",
    "holdings",
    "layouts_of",
    "netlab_batches",
    "netlab_model",
    "parse_layout",
    "predict_broadcast",
    "predict_memory",
    "predict_traffic",
    "rank_layouts",
    "step_flops",
]


@dataclass(frozen=True)
class Workload:
    """The model and the step: a char-GPT (dense when ``n_experts`` is 0) and its batch."""

    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch: int  # sequences in the global batch
    seq: int  # tokens per sequence
    microbatches: int = 1  # per data-parallel rank, for the 1F1B pipeline
    n_experts: int = 0
    top_k: int = 2
    element_size: int = 4  # bytes per number: 4 for float32, 8 for float64

    @classmethod
    def of(cls, model, batch: int, seq: int, microbatches: int = 1, element_size: int = 4):
        """The workload of a char-GPT (dense or MoE) at a batch of ``batch`` x ``seq``."""
        c = model.config
        moe = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        n_experts = len(moe[0].experts) if moe else 0
        top_k = moe[0].router.top_k if moe else 2
        return cls(c.vocab_size, c.n_layer, c.n_embd, c.n_head, c.block_size, batch, seq,
                   microbatches, n_experts, top_k, element_size)  # fmt: skip

    def fits(self, layout: Layout) -> bool:
        """Whether the layout splits this model and batch (see Layout.validate_model)."""
        from dmlbook.models import GPTConfig

        config = GPTConfig(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd)
        try:
            layout.validate_model(config, self.seq, self.batch, self.microbatches, self.n_experts)
        except ValueError:
            return False
        return True


def stage_layers(work: Workload, pp: int) -> list[list[str]]:
    """The layers of each pipeline stage: ``"embed"``, ``"block"`` x n_layer, ``"head"``."""
    layers = ["embed", *["block"] * work.n_layer, "head"]
    out, start = [], 0
    for count in even_partition(len(layers), pp):
        out.append(layers[start : start + count])
        start += count
    return out


def holdings(work: Workload, layout: Layout, rank: int, dims=DEGREE_AXES) -> str:
    """What ``rank`` holds along each of ``dims``, in a few words (for pictures and tables):
    its layers, batch rows, attention heads, sequence positions and experts."""
    c, lines = layout.coordinates(rank), []
    if "pp" in dims:
        layers = stage_layers(work, layout.pp)[: c["pp"] + 1]
        first = sum(len(x) for x in layers[:-1])
        lines.append(f"layers {first}-{first + len(layers[-1]) - 1}")
    if "dp" in dims:
        rows = work.batch // layout.dp
        lines.append(f"rows {c['dp'] * rows}-{(c['dp'] + 1) * rows - 1}")
    if "tp" in dims:
        heads = work.n_head // layout.tp
        lines.append(f"heads {c['tp'] * heads}-{(c['tp'] + 1) * heads - 1}")
    if "cp" in dims:
        chunks = cp_chunks(work.seq // layout.cp, layout.cp, layout.zigzag)[c["cp"]]
        lines.append("tokens " + ",".join(f"{a}-{b - 1}" for a, b in chunks))
    if "ep" in dims and work.n_experts:
        per = work.n_experts // layout.ep
        lines.append(f"experts {c['ep'] * per}-{(c['ep'] + 1) * per - 1}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- parameters


def _parameters(work: Workload, layout: Layout, layer: str) -> list[tuple[int, bool]]:
    """(numel, is_expert) of each parameter of one layer on one rank, in the model's order."""
    c, t, v = work.n_embd, layout.tp, work.vocab_size
    if layer == "embed":
        return [(v // t * c, False), (work.block_size * c, False)]
    if layer == "head":
        return [(c, False), (c, False), (v // t * c, False)]
    ln = [(c, False), (c, False)]
    attn = [(3 * c // t * c, False), (3 * c // t, False), (c * c // t, False), (c, False)]
    if not work.n_experts:
        mlp = [(4 * c // t * c, False), (4 * c // t, False), (c * 4 * c // t, False), (c, False)]
    else:  # the router, then this rank's experts (not split by TP: they run on SP tokens)
        expert = layout.ep > 1
        one = [(4 * c * c, expert), (4 * c, expert), (4 * c * c, expert), (c, expert)]
        mlp = [(work.n_experts * c, False), *one * (work.n_experts // layout.ep)]
    return ln + attn + ln + mlp


def predict_memory(work: Workload, layout: Layout, rank: int) -> dict[str, int]:
    """Bytes ``rank`` holds: ``params``, ``grads``, ``optimizer`` (AdamW, ZeRO-1 over dp x cp,
    experts over edp) and ``activations`` (peak, approximate; see the module)."""
    coords = layout.coordinates(rank)
    e = work.element_size
    layers = stage_layers(work, layout.pp)[coords["pp"]]
    params = [p for layer in layers for p in _parameters(work, layout, layer)]
    memory = {"params": e * sum(n for n, _ in params), "grads": e * sum(n for n, _ in params)}
    optimizer = 0
    for _, mine in _owned(work, layout, rank):
        optimizer += 2 * e * sum(mine) + ADAM_STEP_BYTES * len(mine)
    memory["optimizer"] = optimizer
    live = min(layout.pp - coords["pp"], work.microbatches)
    memory["activations"] = live * sum(_saved(work, layout, layer) for layer in layers)
    return memory


def _owned(work: Workload, layout: Layout, rank: int) -> list[tuple[int, list[int]]]:
    """ZeRO-1's share of ``rank``: for the dense parameters (over dp x cp) and the experts' (over
    edp), the group's size and the sizes of the parameters this rank owns."""
    coords = layout.coordinates(rank)
    layers = stage_layers(work, layout.pp)[coords["pp"]]
    params = [p for layer in layers for p in _parameters(work, layout, layer)]
    shares = []
    for expert, group, index in ((False, layout.dp * layout.cp, coords["dp"] * layout.cp +
                                  coords["cp"]), (True, layout.dp * layout.cp // layout.ep,
                                                  coords["edp"])):  # fmt: skip
        numels = [n for n, is_expert in params if is_expert == expert]
        owners = partition_parameters([numels], group)[0]
        shares.append(
            (group, [n for n, owner in zip(numels, owners, strict=True) if owner == index])
        )
    return shares


def predict_broadcast(work: Workload, layout: Layout, rank: int) -> int:
    """Bytes ``rank`` sends in ZeRO-1's step: each parameter it owns, once to each other rank of
    its group (dense: dp x cp, experts: edp), as a broadcast from the owner does."""
    return sum(
        work.element_size * sum(mine) * (group - 1) for group, mine in _owned(work, layout, rank)
    )


def _saved(work: Workload, layout: Layout, layer: str) -> int:
    """Bytes one micro-batch leaves saved for backward in one layer on one rank (approximate:
    the inputs of every matmul and LayerNorm, attention's q, k, v, output and log-sum-exp)."""
    c, t, e = work.n_embd, layout.tp, work.element_size
    b = work.batch // (layout.dp * work.microbatches)
    s = work.seq // layout.cp  # this CP rank's tokens; s / t of them under sequence parallelism
    whole, sp = b * s * c * e, b * s * c * e // t  # (b, s, C) and its sequence block
    if layer == "embed":
        return INDEX_BYTES * b * s
    if layer == "head":  # LayerNorm input and output, softmax of the split logits, targets
        return 2 * sp + b * s * work.vocab_size // t * e + INDEX_BYTES * b * s
    stats = 2 * 2 * b * (s // t) * e  # two LayerNorms' mean and 1 / std
    attention = 5 * whole // t + b * (work.n_head // t) * s * e  # q, k, v, out, proj in; lse
    if layout.cp > 1:  # ring attention keeps every block's scores: (s x s) per head, causal
        attention += 2 * b * (work.n_head // t) * s * s * e
    if not work.n_experts:
        mlp = sp + 2 * 4 * whole // t  # fc input (its block), GELU input and output
    else:  # router input and probabilities, then k rows per token through an expert
        tokens = b * s // t
        mlp = sp + 3 * tokens * work.n_experts * e + work.top_k * tokens * 11 * c * e
    return 4 * sp + stats + attention + mlp


# --------------------------------------------------------------------------- traffic


@dataclass
class PredictedTraffic:
    """Bytes a rank is predicted to send in one step per axis of :data:`~dmlbook.advanced.
    composition.layout.DEGREE_AXES` (``dp`` counts the whole ``dp_cp`` gradient sync), and its
    messages (critical-path steps)."""

    sent: dict[Axis, float] = field(default_factory=lambda: dict.fromkeys(DEGREE_AXES, 0.0))
    messages: dict[Axis, int] = field(default_factory=lambda: dict.fromkeys(DEGREE_AXES, 0))

    def add(self, dim: str, kind: str, n: int, nbytes: float, calls: int = 1) -> None:
        """``calls`` ring collectives (``kind``: "ag", "rs", "ar") over ``n`` ranks of a tensor
        of ``nbytes`` bytes, or ``"p2p"`` messages of ``nbytes`` each."""
        if n <= 1 or calls == 0:
            return
        share, steps = {"ag": ((n - 1) / n, n - 1), "rs": ((n - 1) / n, n - 1),
                        "ar": (2 * (n - 1) / n, 2 * (n - 1)), "p2p": (1.0, 1)}[kind]  # fmt: skip
        self.sent[dim] += calls * share * nbytes
        self.messages[dim] += calls * steps


def predict_traffic(work: Workload, layout: Layout, rank: int) -> PredictedTraffic:
    """What ``rank`` sends in one step of
    :func:`~dmlbook.advanced.composition.training.train_composed`."""
    coords = layout.coordinates(rank)
    c, t, cp, e, m = work.n_embd, layout.tp, layout.cp, work.element_size, work.microbatches
    b = work.batch // (layout.dp * m)
    s = work.seq // cp
    whole = b * s * c * e  # (b, s, C): the CP rank's activations of one micro-batch
    check = 4 * INDEX_BYTES * t  # a reduce-scatter's whole-shape check: every TP rank's (ndim,
    # B, T, C); the other collectives' checks ride in their own headers, not counted as messages
    layers = stage_layers(work, layout.pp)[coords["pp"]]
    out = PredictedTraffic()
    for layer in layers:  # per micro-batch, then times m
        if layer == "embed":
            out.add("tp", "ar", t, whole, m)  # vocabulary-parallel lookup, forward
            out.add("tp", "ag", t, whole, m)  # the sequence cut: all-gather backward
        elif layer == "head":
            out.add("tp", "ar", t, c * e, 2 * m)  # ln_f's weight and bias gradients
            out.add("tp", "ag", t, whole, 2 * m)  # lm_head: all-gather forward and backward
            out.add("tp", "rs", t, whole, m)  # ... and its input's gradient
            out.add("tp", "ar", t, 3 * b * s * e, m)  # the split loss: max, sum of exp, target
        else:
            linears = 2 if work.n_experts else 4  # an MoE is not split by TP
            out.add("tp", "ag", t, whole, linears // 2 * 2 * m)  # column: fwd, bwd again
            out.add("tp", "rs", t, whole, linears // 2 * m)  # column: input gradient
            out.add("tp", "rs", t, whole, linears // 2 * m)  # row: forward
            out.add("tp", "ag", t, whole, linears // 2 * m)  # row: backward
            out.add("tp", "ar", t, c * e, (4 + linears // 2) * m)  # LayerNorms, row biases
            out.add("tp", "ag", t, check, linears // 2 * m)  # each forward reduce-scatter's
            if work.n_experts:  # MoE weights see only SP tokens: gradients summed over TP
                moe = [n for n, _ in _parameters(work, layout, "block")[8:]]
                for n in moe:
                    out.add("tp", "ar", t, n * e, m)
                _experts(out, work, layout, b * s // t)
            if cp > 1:  # the K/V block round the ring, forward, and its gradient back
                out.add("cp", "p2p", 2, 2 * whole // t, 2 * (cp - 1) * m)
                out.add("cp", "ag", cp, 5 * INDEX_BYTES * cp, m)  # the shape check
    if coords["pp"] < layout.pp - 1:
        out.add("pp", "p2p", 2, whole // t, m)  # activations forward, sequence-split
    if coords["pp"] > 0:
        out.add("pp", "p2p", 2, whole // t, m)  # gradients back
    params = [p for layer in layers for p in _parameters(work, layout, layer)]
    dense = e * sum(n for n, expert in params if not expert)
    experts = e * sum(n for n, expert in params if expert)
    out.add("dp", "ar", layout.dp * layout.cp, dense)
    out.add("dp", "ar", layout.dp * layout.cp // layout.ep, experts)
    return out


def _experts(out: PredictedTraffic, work: Workload, layout: Layout, tokens: int) -> None:
    """Dispatch and combine, forward and backward, of ``tokens`` x k rows under an even
    spread, and the counts exchanged before each dispatch."""
    ep, m, c, e = layout.ep, work.microbatches, work.n_embd, work.element_size
    if ep <= 1:
        return
    rows = tokens * work.top_k * (ep - 1) / ep
    out.sent["ep"] += 4 * m * rows * c * e + m * work.n_experts * (ep - 1) / ep * INDEX_BYTES
    out.messages["ep"] += 5 * m * (ep - 1)


# --------------------------------------------------------------------------- time and ranking


@dataclass(frozen=True)
class Network:
    """Two levels: ``gpus_per_node`` consecutive ranks share the fast ``intra`` link; groups
    that span nodes run at the slow ``inter`` link. ``flops`` is each rank's compute rate."""

    intra: Link
    inter: Link
    gpus_per_node: int
    flops: float = 1e10

    def link(self, ranks: list[int]) -> Link:
        nodes = {r // self.gpus_per_node for r in ranks}
        return self.intra if len(nodes) == 1 else self.inter


def step_flops(work: Workload) -> float:
    """Training FLOPs of one step (6 x parameters x tokens, plus attention's scores)."""
    c = work.n_embd
    per_block = 12 * c * c if not work.n_experts else 4 * c * c + work.top_k * 8 * c * c
    params = work.n_layer * per_block + work.vocab_size * c
    tokens = work.batch * work.seq
    return 6 * params * tokens + 6 * work.n_layer * tokens * work.seq * c


def step_time(work: Workload, layout: Layout, network: Network) -> dict[str, float]:
    """Seconds of one step by the alpha-beta model, per part: ``compute`` (the slowest stage's
    share of the FLOPs, stretched by the 1F1B bubble ``(pp - 1) / microbatches``) and each
    dimension's traffic over its group's link, for the busiest rank; ``total`` is their sum."""
    worst: dict[str, float] = {}
    for rank in range(layout.world_size):
        traffic, groups = predict_traffic(work, layout, rank), layout.groups_of(rank)
        for dim in DEGREE_AXES:
            group = groups[Axis.dp_cp if dim == Axis.dp else dim]
            link = network.link(group)
            secs = traffic.messages[dim] * link.alpha + traffic.sent[dim] * link.beta
            worst[dim] = max(worst.get(dim, 0.0), secs)
    share = step_flops(work) / layout.world_size / network.flops
    worst["compute"] = share * (1 + (layout.pp - 1) / work.microbatches)
    worst["total"] = sum(worst.values())
    return worst


def layouts_of(world_size: int, work: Workload | None = None) -> list[Layout]:
    """Every layout of ``world_size`` ranks (the ``work`` fits, when given)."""
    out = []
    for dp, tp, pp, cp in itertools.product(range(1, world_size + 1), repeat=4):
        if dp * tp * pp * cp != world_size:
            continue
        eps = [d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0]
        for ep in eps if work is not None and work.n_experts else [1]:
            layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
            if work is None or work.fits(layout):
                out.append(layout)
    return out


def rank_layouts(work: Workload, world_size: int, network: Network) -> list[tuple[Layout, dict]]:
    """The layouts of ``world_size`` that fit ``work``, cheapest predicted step first."""
    costed = [(layout, step_time(work, layout, network)) for layout in layouts_of(world_size, work)]
    return sorted(costed, key=lambda lc: lc[1]["total"])


def parse_layout(text: str) -> Layout:
    """``"dp2.tp2.pp2"`` (or ``"dp2 x tp2 x pp2"``, as ``str(layout)`` writes it) as a Layout."""
    sizes = {}
    for part in text.replace(" x ", ".").split("."):
        name, value = part[:2], part[2:]
        if name not in DEGREE_AXES or not value.isdigit():
            raise ValueError(f"cannot read {part!r} of {text!r}: write e.g. dp2.tp2.pp2")
        sizes[name] = int(value)
    return Layout(**sizes)


# The workload chapter 13 times on the network lab (examples/composed_layouts.py): big enough
# that a layout's traffic over a shaped link shows in its step time, small enough for 2 cores.
NETLAB_MODEL = dict(n_layer=2, n_head=8, n_embd=64, block_size=32)
NETLAB_VOCAB, NETLAB_BATCH, NETLAB_SEQ = 64, 16, 32


def netlab_model():
    """The char-GPT that chapter 13 times (float32, seed 0)."""
    from dmlbook.models import char_gpt

    return char_gpt(NETLAB_VOCAB, seed=0, **NETLAB_MODEL)


def netlab_batches(steps: int):
    """``steps`` batches of random tokens for :func:`netlab_model`."""
    import torch

    g = torch.Generator().manual_seed(0)
    shape = (NETLAB_BATCH, NETLAB_SEQ)
    return [
        (torch.randint(0, NETLAB_VOCAB, shape, generator=g),
         torch.randint(0, NETLAB_VOCAB, shape, generator=g))
        for _ in range(steps)
    ]  # fmt: skip
