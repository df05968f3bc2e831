"""Knowledge distillation: train a small student to match a large teacher's softened outputs.

Chapter 8 ("Achieving higher throughput and lower latency") serves a smaller model trained from
a bigger one. Hinton, Vinyals and Dean (2015, "Distilling the Knowledge in a Neural Network")
soften both models' outputs with a temperature ``T``, ``softmax(z / T)``, so that the teacher's
small probabilities (this 3 looks a little like an 8) carry information, and train the student on

    alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, y)

The ``T^2`` keeps the soft term's gradients the same size whatever ``T`` is (they scale as
``1 / T^2``). :func:`train_student` trains the same student with and without a teacher, from the
same initial weights on the same batches, so that the teacher is the only difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["distillation_loss", "soft_target_loss", "train_student"]


def soft_target_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``T^2 * KL(p_teacher || p_student)`` at temperature ``T``, averaged over the samples.

    Logits are ``(N, C)``; a sequence model's ``(B, T, V)`` counts every position as a sample.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape"
        )
    s = student_logits.flatten(0, -2) / temperature  # (N, C)
    t = teacher_logits.detach().flatten(0, -2) / temperature  # the teacher is not trained
    log_p_teacher = F.log_softmax(t, dim=-1)
    log_p_student = F.log_softmax(s, dim=-1)
    # KL(p || q) = sum_c p_c (log p_c - log q_c), per sample; then the mean over samples.
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(dim=-1)  # (N,)
    return temperature**2 * kl.mean()


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 4.0,
    alpha: float = 0.9,
) -> torch.Tensor:
    """Hinton et al.'s loss: ``alpha`` of the soft-target loss plus ``1 - alpha`` of the usual
    cross-entropy with the true labels (the hard targets)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    hard = F.cross_entropy(student_logits.flatten(0, -2), targets.flatten())
    soft = soft_target_loss(student_logits, teacher_logits, temperature)
    return alpha * soft + (1 - alpha) * hard


@dataclass
class StudentRun:
    """A trained student and its per-step training loss."""

    student: nn.Module
    losses: list[float] = field(default_factory=list)


def train_student(
    student: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    teacher: nn.Module | None = None,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 1e-2,
    temperature: float = 4.0,
    alpha: float = 0.9,
    seed: int = 0,
) -> StudentRun:
    """Train ``student`` in place with Adam on random batches drawn by ``seed``: with
    ``teacher``, on :func:`distillation_loss`; without, on cross-entropy alone. Same
    seed, same steps: both runs see the same batches in the same order."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    if len(inputs) != len(targets):
        raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
    teacher_logits = None
    if teacher is not None:
        was_training = teacher.training
        with torch.no_grad():
            teacher_logits = teacher.eval()(inputs)  # the soft targets, computed once
        teacher.train(was_training)
    optimizer = torch.optim.Adam(student.parameters(), lr=lr)
    batches = torch.Generator().manual_seed(seed)
    run = StudentRun(student.train())
    for _ in range(steps):
        idx = torch.randint(len(inputs), (batch_size,), generator=batches)
        logits = student(inputs[idx])
        if teacher_logits is None:
            loss = F.cross_entropy(logits.flatten(0, -2), targets[idx].flatten())
        else:
            loss = distillation_loss(logits, teacher_logits[idx], targets[idx], temperature, alpha)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        run.losses.append(loss.item())
    student.eval()
    return run
