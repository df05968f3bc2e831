"""Chapter 8's distillation loss against a hand computation and torch's F.kl_div, its T^2
scaling, and the student trainer's determinism."""

import math

import pytest
import torch
from torch.nn import functional as F

from dmlbook.model_parallel.efficiency.distillation import (
    distillation_loss,
    soft_target_loss,
    train_student,
)
from dmlbook.models import mlp

pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(n=6, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(n, classes, generator=g), 3 * torch.randn(n, classes, generator=g)


def test_soft_target_loss_by_hand():
    # Two classes: the student says 50/50, the teacher's logits are (ln 3, 0).
    student = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0]])
    p = [0.75, 0.25]  # softmax(ln 3, 0) at T = 1
    expected = sum(pc * math.log(pc / 0.5) for pc in p)
    assert soft_target_loss(student, teacher, 1.0).item() == pytest.approx(expected, rel=1e-6)
    # At T = 2 the teacher softens to softmax(ln 3 / 2, 0) = (sqrt 3, 1) / (1 + sqrt 3),
    # and the KL is multiplied by T^2 = 4.
    r3 = math.sqrt(3.0)
    p = [r3 / (1 + r3), 1 / (1 + r3)]
    expected = 4 * sum(pc * math.log(pc / 0.5) for pc in p)
    assert soft_target_loss(student, teacher, 2.0).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0, 10.0])
def test_soft_target_loss_matches_torch_kl_div(temperature):
    student, teacher = _logits()
    theirs = temperature**2 * F.kl_div(
        F.log_softmax(student / temperature, dim=-1),
        F.log_softmax(teacher / temperature, dim=-1),
        reduction="batchmean",  # the mathematical KL per sample; "mean" would divide by C too
        log_target=True,
    )
    torch.testing.assert_close(soft_target_loss(student, teacher, temperature), theirs)


def test_distillation_loss_mixes_soft_and_hard_targets():
    student, teacher = _logits()
    targets = torch.tensor([0, 1, 2, 3, 4, 0])
    hard = F.cross_entropy(student, targets)
    soft = soft_target_loss(student, teacher, 3.0)
    torch.testing.assert_close(distillation_loss(student, teacher, targets, 3.0, 0.0), hard)
    torch.testing.assert_close(distillation_loss(student, teacher, targets, 3.0, 1.0), soft)
    torch.testing.assert_close(
        distillation_loss(student, teacher, targets, 3.0, 0.7), 0.7 * soft + 0.3 * hard
    )
    # A sequence model's (B, T, V) logits count every position as a sample.
    seq_s, seq_t = student.reshape(2, 3, 5), teacher.reshape(2, 3, 5)
    torch.testing.assert_close(
        distillation_loss(seq_s, seq_t, targets.reshape(2, 3), 3.0, 0.7),
        distillation_loss(student, teacher, targets, 3.0, 0.7),
    )


def test_t_squared_keeps_the_gradient_size_and_the_teacher_gets_none():
    student, teacher = _logits(classes=10)
    student, teacher = student - student.mean(1, keepdim=True), teacher - teacher.mean(1, True)
    norms = []
    for temperature in (8.0, 16.0, 32.0):
        s = student.clone().requires_grad_()
        t = teacher.clone().requires_grad_()
        soft_target_loss(s, t, temperature).backward()
        assert t.grad is None  # the teacher is a fixed target
        norms.append(s.grad.norm().item())
    # Without T^2 the gradient would shrink 4x per doubling; with it, it stays put (for high T
    # it tends to (student - teacher) / (N C), Hinton et al. 2015 section 2.1).
    assert max(norms) < 1.15 * min(norms)
    limit = ((student - teacher) / (student.numel())).norm().item()
    assert norms[-1] == pytest.approx(limit, rel=0.05)


def test_train_student_is_deterministic_and_the_teacher_matters():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(3, (64,), generator=g)
    teacher = mlp(seed=5, in_features=8, hidden=(16,), out_features=3)

    def student():
        return mlp(seed=1, in_features=8, hidden=(4,), out_features=3)

    alone = train_student(student(), x, y, steps=10, batch_size=8, seed=3)
    again = train_student(student(), x, y, steps=10, batch_size=8, seed=3)
    taught = train_student(student(), x, y, teacher=teacher, steps=10, batch_size=8, seed=3)
    assert len(alone.losses) == 10 and alone.losses == again.losses
    for a, b in zip(alone.student.parameters(), again.student.parameters(), strict=True):
        assert torch.equal(a, b)
    assert taught.losses != alone.losses
    assert not alone.student.training


def test_bad_input_is_a_clear_error():
    student, teacher = _logits()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        soft_target_loss(student, teacher, 0.0)
    with pytest.raises(ValueError, match="differ in shape"):
        soft_target_loss(student, teacher[:, :4], 2.0)
    with pytest.raises(ValueError, match="alpha must be"):
        distillation_loss(student, teacher, torch.zeros(6, dtype=torch.long), 2.0, 1.5)
    with pytest.raises(ValueError, match="6 inputs but 5 targets"):
        train_student(mlp(in_features=5), student, torch.zeros(5, dtype=torch.long))
