"""Checkers for chapter 8's exercises ("Achieving higher throughput and lower latency").

1. ``check_freeze_first``: write ``freeze_first(layers, k)``: the parameters of the first ``k``
   layers stop training (``requires_grad=False``) and every later layer trains
   (:mod:`dmlbook.model_parallel.efficiency.freezing`).
2. ``check_energy_rank``: write ``energy_rank(weight, keep)``: the smallest rank ``r`` whose
   ``r`` largest singular values keep at least ``keep`` of the matrix's energy, the sum of the
   *squared* singular values (:mod:`dmlbook.model_parallel.efficiency.lowrank`).
3. ``check_distillation_loss``: write ``distillation_loss(student_logits, teacher_logits,
   targets, T, alpha)``, Hinton et al.'s ``alpha * T^2 * KL(softmax(teacher / T) ||
   softmax(student / T)) + (1 - alpha) * CE(student, targets)``, the KL summed over classes and
   averaged over samples (:mod:`dmlbook.model_parallel.efficiency.distillation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from dmlbook.exercises import ExerciseFailed, checker, learner_code
from dmlbook.model_parallel.efficiency.distillation import distillation_loss
from dmlbook.model_parallel.efficiency.layers import as_layers
from dmlbook.model_parallel.efficiency.lowrank import energy_rank
from dmlbook.models import char_gpt, mlp

__all__ = ["check_distillation_loss", "check_energy_rank", "check_freeze_first"]

# --------------------------------------------------------------------------- 1. freezing


def _flags(layers: nn.ModuleList) -> list[list[bool]]:
    return [[p.requires_grad for p in layer.parameters()] for layer in layers]


def _freeze_hint(layers: nn.ModuleList, flags: list[list[bool]], k: int, was: list) -> str:
    n = len(layers)
    frozen = [not any(f) for f in flags]
    if k > 0 and not any(frozen[:k]):
        if any(not layer.training for layer in layers[:k]):
            return (
                ": layer.eval() only switches dropout and batch norm to inference; the "
                "parameters still get gradients and still train. Freezing is requires_grad=False"
            )
        if any(p.grad is None for layer in layers[:k] for p in layer.parameters()):
            return (
                ": p.grad = None only clears a gradient that the next backward fills again; "
                "freezing is p.requires_grad_(False), which stops backward from computing it"
            )
    if any(layer.__dict__.get("requires_grad") is False for layer in layers):
        return (
            ": setting `layer.requires_grad = False` only adds an attribute to the module; "
            "freeze its parameters with layer.requires_grad_(False), or set p.requires_grad on "
            "each p in layer.parameters()"
        )
    if any(any(f) and not all(f) for f in flags):
        return ": freeze every parameter of a layer (its weights and its biases)"
    if frozen == [i >= n - k for i in range(n)]:
        return ": you froze the LAST k layers; freeze the first k (the ones next to the input)"
    for off in (-1, 1):
        if 0 <= k + off <= n and frozen == [i < k + off for i in range(n)]:
            return f": you froze {k + off} layers instead of {k} (an off-by-one)"
    if any(frozen[i] and was[i] for i in range(k, n)):
        return (
            ": layers after the first k stayed frozen from an earlier call; make them "
            "trainable again (requires_grad=True)"
        )
    return ""


@checker(
    "freeze_first",
    writes=(
        "dmlbook.model_parallel.efficiency.freezing.freeze_first",
        "dmlbook.model_parallel.efficiency.freezing.freeze",
    ),
)
def check_freeze_first(fn: Callable[[nn.ModuleList, int], None]) -> str:
    """Check ``fn(layers, k)`` on an MLP and a char-GPT (as ``as_layers`` lists), for every k,
    in an order that goes down as well as up: exactly the first k layers are frozen."""
    models = {
        "a 4-layer MLP": mlp(seed=0, in_features=8, hidden=(8, 8, 8), out_features=3),
        "a char-GPT (embedding, 2 blocks, head)": char_gpt(11, seed=0, n_layer=2, n_embd=16),
    }
    for name, model in models.items():
        layers = as_layers(model)
        n = len(layers)
        for k in (2, 0, n, 1, 3, n - 1):
            was = [not any(f) for f in _flags(layers)]
            model.train()
            for p in model.parameters():  # a gradient from an earlier step, as in training
                p.grad = torch.zeros_like(p)
            with learner_code(f"your freeze_first on {name} with k={k}"):
                fn(layers, k)
            flags = _flags(layers)
            want = [[i >= k] * len(f) for i, f in enumerate(flags)]
            if flags != want:
                got = ", ".join(
                    f"layer {i}: {'frozen' if not any(f) else 'trainable' if all(f) else 'mixed'}"
                    for i, f in enumerate(flags)
                )
                raise ExerciseFailed(
                    f"on {name} with k={k}: expected layers 0..{k - 1} frozen and the rest "
                    f"trainable, got {got}" + _freeze_hint(layers, flags, k, was)
                )
    return "exactly the first k layers frozen, on an MLP and a char-GPT, for k up and down"


# --------------------------------------------------------------------------- 2. energy rank


def _energy_cases() -> list[tuple[str, torch.Tensor, float]]:
    g = torch.Generator().manual_seed(8)
    # Squared: 9, 4, 1, 1, 1, total 16, whose root is exact: every fraction below is exact in
    # float32 and float64, however the total is computed (sum of squares or norm ** 2).
    boundary = torch.diag(torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0]))
    decaying = torch.randn(20, 50, generator=g) * torch.logspace(0, -2, 50)
    return [
        ("diag(3, 2, 1, 1, 1), keep=0.875 (exactly 14/16 at rank 3)", boundary, 0.875),
        ("diag(3, 2, 1, 1, 1), keep=0.5625 (exactly 9/16 at rank 1)", boundary, 0.5625),
        ("diag(3, 2, 1, 1, 1), keep=0.9", boundary, 0.9),
        ("a 20x50 matrix with decaying columns, keep=0.9", decaying, 0.9),
        ("a 20x50 matrix with decaying columns, keep=0.99", decaying, 0.99),
        ("a random 30x12 matrix, keep=0.5", torch.randn(30, 12, generator=g), 0.5),
    ]


def _first_reaching(fractions: torch.Tensor, keep: float, strict: bool = False) -> int:
    """1 + how many of the growing ``fractions`` fall short of ``keep`` (or reach it, strict)."""
    short = fractions <= keep + 1e-12 if strict else fractions < keep - 1e-12
    return int(short.sum()) + 1


def _energy_bugs(weight: torch.Tensor, keep: float) -> dict[str, int]:
    """The rank each common mistake returns, keyed by the hint that names it."""
    s = torch.linalg.svdvals(weight.double())
    kept = (s**2).cumsum(0) / (s**2).sum()  # energy kept by ranks 1, 2, ...
    right = _first_reaching(kept, keep)
    return {
        "you measured energy with the singular values; energy is their SQUARES": (
            _first_reaching(s.cumsum(0) / s.sum(), keep)
        ),
        "a rank that keeps exactly `keep` of the energy is enough (>=, not >)": (
            _first_reaching(kept, keep, strict=True)
        ),
        "you kept a fraction of the NUMBER of singular values; keep a fraction of their energy, "
        "the sum of their squares, largest first": math.ceil(keep * len(s) - 1e-12),
        "you took `keep` of the number of singular values, rounded down; keep a fraction of "
        "their energy, the sum of their squares, largest first": max(1, int(keep * len(s))),
        "an off-by-one: ranks count from 1 (rank r keeps sigma_1..sigma_r)": right - 1,
        "an off-by-one: rank r keeps sigma_1..sigma_r, the first r values": right + 1,
    }


@checker("energy_rank", writes=("dmlbook.model_parallel.efficiency.lowrank.energy_rank",))
def check_energy_rank(fn: Callable[[torch.Tensor, float], int]) -> str:
    """Check ``fn(weight, keep) -> r``: the smallest rank keeping ``keep`` of the energy."""
    cases = _energy_cases()
    answers = []
    for name, weight, keep in cases:
        with learner_code(f"your energy_rank on {name}"):
            got = fn(weight.clone(), keep)
        try:
            answers.append(int(got))
        except (TypeError, ValueError, RuntimeError):
            raise ExerciseFailed(f"on {name}: return the rank as an int, got {got!r}") from None
    for (name, weight, keep), got in zip(cases, answers, strict=True):
        want = energy_rank(weight, keep)
        if got != want:
            # Name the mistake whose answers match the learner's on every case, if one does.
            bugs = [_energy_bugs(w, k) for _, w, k in cases]
            hint = next((f": {bug}" for bug in bugs[0] if [b[bug] for b in bugs] == answers), "")
            energy = torch.linalg.svdvals(weight.double()) ** 2
            kept = (energy.cumsum(0) / energy.sum()).tolist()
            if not hint and got == want + 1 and abs(kept[want - 1] - keep) < 1e-6:
                hint = (
                    f": rank {want} keeps {kept[want - 1]:.12g} of the energy, `keep` to within "
                    "rounding, and is enough (>=, not >). If you compared with >=, rounding "
                    "pushed your fraction below `keep`: allow a tolerance (>= keep - 1e-9)"
                )
            raise ExerciseFailed(f"on {name}: expected rank {want}, got {got}{hint}")
    return "the smallest rank that keeps the energy, on 6 matrices (2 exactly on the boundary)"


# --------------------------------------------------------------------------- 3. distillation


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per sample, from log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def _distillation_bugs(s, t, y, temperature, alpha) -> list[tuple[str, torch.Tensor]]:
    """(hint, the value that mistake gives) for each common mistake."""
    T, a = temperature, alpha
    hard = (1 - a) * F.cross_entropy(s, y)
    ls, lt = F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)
    kl = _kl(lt, ls)  # (N,): the right per-sample KL
    return [
        ("multiply the soft term by T^2 (its gradients shrink as 1 / T^2 otherwise)",
         a * kl.mean() + hard),
        ("the KL goes from the teacher to the student, KL(p_teacher || p_student): weight the "
         "log-ratio by the TEACHER's probabilities", a * T**2 * _kl(ls, lt).mean() + hard),
        ("sum the KL over the classes and average over the samples only (F.kl_div's "
         "reduction='mean' also divides by the number of classes; use 'batchmean')",
         a * T**2 * kl.mean() / s.shape[-1] + hard),
        ("soften the teacher too: divide the teacher's logits by T",
         a * T**2 * _kl(F.log_softmax(t, -1), ls).mean() + hard),
        ("soften the student too: divide the student's logits by T",
         a * T**2 * _kl(lt, F.log_softmax(s, -1)).mean() + hard),
        ("alpha weights the SOFT term and 1 - alpha the hard cross-entropy",
         (1 - a) * T**2 * kl.mean() + a * F.cross_entropy(s, y)),
        ("average over the samples, do not sum", (a * T**2 * kl.mean() + hard) * len(s)),
        ("F.kl_div's reduction='sum' sums over the samples too; use reduction='batchmean' "
         "(sum over the classes, mean over the samples)", a * T**2 * kl.sum() + hard),
        ("F.kl_div takes the student's LOG-probabilities as its first argument "
         "(F.log_softmax(student / T)), not its probabilities",
         a * T**2 * (lt.exp() * (lt - ls.exp())).sum(-1).mean() + hard),
        ("the hard term is the cross-entropy of the student's plain logits (no temperature): "
         "F.cross_entropy(student_logits, targets), not of student / T",
         a * T**2 * kl.mean() + (1 - a) * F.cross_entropy(s / T, y)),
        ("you computed the soft cross-entropy -sum p_teacher log p_student; the KL is that minus "
         "the teacher's entropy (-sum p_teacher log p_teacher). Both give the student the same "
         "gradient, but the loss value (the curve a run prints) differs by "
         "alpha * T^2 * entropy: subtract it, or compute sum p_teacher (log p_teacher - "
         "log p_student)", a * T**2 * -(lt.exp() * ls).sum(-1).mean() + hard),
    ]  # fmt: skip


@checker(
    "distillation_loss",
    writes=(
        "dmlbook.model_parallel.efficiency.distillation.distillation_loss",
        "dmlbook.model_parallel.efficiency.distillation.soft_target_loss",
    ),
)
def check_distillation_loss(fn: Callable[..., torch.Tensor]) -> str:
    """Check ``fn(student_logits, teacher_logits, targets, T, alpha)``: its value and its
    gradient for the student, against the reference on 4 settings of T and alpha."""
    g = torch.Generator().manual_seed(8)
    for temperature, alpha in ((4.0, 0.7), (2.0, 0.9), (1.0, 0.5), (8.0, 0.0)):
        student = 3 * torch.randn(12, 6, generator=g)
        teacher = 3 * torch.randn(12, 6, generator=g)
        targets = torch.randint(6, (12,), generator=g)
        setting = f"T={temperature}, alpha={alpha} (12 samples, 6 classes)"
        s = student.clone().requires_grad_()
        with learner_code(f"your distillation_loss with {setting}"):
            loss = fn(s, teacher.clone(), targets.clone(), temperature, alpha)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ExerciseFailed(f"with {setting}: return the loss as a one-element tensor")
        with learner_code(f"backward through your distillation_loss with {setting}"):
            loss.backward()
        ref_s = student.clone().requires_grad_()
        want = distillation_loss(ref_s, teacher, targets, temperature, alpha)
        want.backward()
        if torch.isnan(loss.detach()).any():
            raise ExerciseFailed(
                f"with {setting}: your loss is nan. F.kl_div(input, target) wants the target as "
                "probabilities (F.softmax(teacher / T)); with log-probabilities as the target, "
                "pass log_target=True"
            )
        if not torch.allclose(loss.detach().reshape(()), want.detach(), rtol=1e-4, atol=1e-6):
            hint = ""
            bugs = _distillation_bugs(student, teacher, targets, temperature, alpha)
            for bug, value in bugs:
                if torch.allclose(loss.detach().reshape(()), value, rtol=1e-4, atol=1e-6):
                    hint = f": {bug}"
                    break
            raise ExerciseFailed(
                f"with {setting}: expected {want.item():.6f}, got {loss.item():.6f}{hint}"
            )
        if s.grad is None or not torch.allclose(s.grad, ref_s.grad, rtol=1e-4, atol=1e-7):
            raise ExerciseFailed(
                f"with {setting}: the value is right but the gradient for the student logits is "
                "not; build the loss from the student logits with differentiable torch operations"
            )
    return "value and gradient match Hinton et al.'s loss for 4 settings of T and alpha"
