"""Chapter 8's exercise checkers: right answers pass, unanswered ones are "not attempted", and
planted bugs are caught with a message that names the mistake."""

import math

import pytest
import torch
from torch.nn import functional as F

from dmlbook.exercises import ExerciseFailed, ch08
from dmlbook.model_parallel.efficiency import distillation, freezing, lowrank

pytestmark = pytest.mark.usefixtures("one_thread")


def unanswered(*args):
    raise NotImplementedError


# ---- 1. freeze the first k layers -----------------------------------------------------------


def freeze_first(layers, k):
    for i, layer in enumerate(layers):
        layer.requires_grad_(i >= k)


def freeze_module_attribute(layers, k):
    for i, layer in enumerate(layers):
        layer.requires_grad = i >= k  # a plain attribute: the parameters never hear of it


def freeze_last(layers, k):
    for i, layer in enumerate(layers):
        layer.requires_grad_(i < len(layers) - k)


def freeze_one_too_many(layers, k):
    for i, layer in enumerate(layers):
        layer.requires_grad_(i > k)


def freeze_weights_only(layers, k):
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            p.requires_grad_(i >= k or not name.endswith("weight"))


def freeze_never_unfreeze(layers, k):
    for layer in layers[:k]:
        layer.requires_grad_(False)


def freeze_by_eval(layers, k):
    for layer in layers[:k]:
        layer.eval()


def freeze_by_clearing_grads(layers, k):
    for layer in layers[:k]:
        for p in layer.parameters():
            p.grad = None


def test_freeze_first_passes_the_right_answer():
    assert ch08.check_freeze_first(freeze_first).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (freeze_module_attribute, r"layer.requires_grad_\(False\)"),
        (freeze_last, "you froze the LAST k layers"),
        (freeze_one_too_many, "an off-by-one"),
        (freeze_weights_only, "weights and its biases"),
        (freeze_never_unfreeze, "stayed frozen from an earlier call"),
        (freeze_by_eval, r"eval\(\) only switches dropout"),
        (freeze_by_clearing_grads, "p.grad = None only clears a gradient"),
    ],
)
def test_freeze_first_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch08.check_freeze_first(answer)


# ---- 2. the rank that keeps a fraction of the energy ----------------------------------------


def energy_rank(weight, keep):
    energy = torch.linalg.svdvals(weight) ** 2
    kept = energy.cumsum(0) / energy.sum()
    return int((kept < keep).sum()) + 1


def energy_rank_of_sigmas(weight, keep):
    sigma = torch.linalg.svdvals(weight)
    return int((sigma.cumsum(0) / sigma.sum() < keep).sum()) + 1


def energy_rank_strict(weight, keep):
    energy = torch.linalg.svdvals(weight) ** 2
    return int((energy.cumsum(0) / energy.sum() <= keep).sum()) + 1


def energy_rank_zero_based(weight, keep):
    energy = torch.linalg.svdvals(weight) ** 2
    return int((energy.cumsum(0) / energy.sum() < keep).sum())


def energy_rank_from_the_norm(weight, keep):
    # The total energy as ||W||_F^2 from the norm, in float64: rounds on most matrices.
    energy = torch.linalg.svdvals(weight.double()) ** 2
    return int((energy.cumsum(0) / weight.double().norm() ** 2 < keep).sum()) + 1


def energy_rank_fraction_of_count(weight, keep):
    return math.ceil(keep * min(weight.shape))


def energy_rank_rounding_only(weight, keep):
    energy = torch.linalg.svdvals(weight.double()) ** 2
    kept = energy.cumsum(0) / energy.sum()
    if weight.shape == (5, 5) and keep == 0.875:
        kept = kept * (1 - 1e-15)  # as a total that rounded up would
    return int((kept < keep).sum()) + 1


def test_energy_rank_passes_the_right_answer():
    assert ch08.check_energy_rank(energy_rank).status == "passed"
    assert ch08.check_energy_rank(energy_rank_from_the_norm).status == "passed"


def test_energy_rank_names_rounding_at_the_boundary():
    with pytest.raises(ExerciseFailed, match="rounding pushed your fraction below"):
        ch08.check_energy_rank(energy_rank_rounding_only)


@pytest.mark.parametrize(
    "answer, message",
    [
        (energy_rank_of_sigmas, "energy is their SQUARES"),
        (energy_rank_strict, r"\(>=, not >\)"),
        (energy_rank_zero_based, "off-by-one"),
        (energy_rank_fraction_of_count, "fraction of the NUMBER of singular values"),
        (lambda w, keep: "two", "return the rank as an int"),
    ],
)
def test_energy_rank_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch08.check_energy_rank(answer)


# ---- 3. the distillation loss ---------------------------------------------------------------


def kl(log_p, log_q):
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def distill(s, t, y, T, alpha):
    soft = kl(F.log_softmax(t / T, -1), F.log_softmax(s / T, -1)).mean()
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def distill_with_torch_kl_div(s, t, y, T, alpha):
    soft = F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction="batchmean")
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def distill_no_t_squared(s, t, y, T, alpha):
    return (
        distill(s, t, y, T, alpha)
        - alpha * (T**2 - 1) * kl(F.log_softmax(t / T, -1), F.log_softmax(s / T, -1)).mean()
    )


def distill_reversed_kl(s, t, y, T, alpha):
    soft = kl(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)).mean()
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def distill_kl_div_mean(s, t, y, T, alpha):
    soft = F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction="mean")
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def distill_hard_teacher(s, t, y, T, alpha):
    soft = kl(F.log_softmax(t, -1), F.log_softmax(s / T, -1)).mean()
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def distill_swapped_alpha(s, t, y, T, alpha):
    return distill(s, t, y, T, 1 - alpha)


def distill_detached_student(s, t, y, T, alpha):
    return distill(s.detach(), t, y, T, alpha) + 0 * s.sum()


def distill_kl_div_sum(s, t, y, T, alpha):
    soft = F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction="sum")
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def distill_kl_div_of_probabilities(s, t, y, T, alpha):
    soft = F.kl_div(F.softmax(s / T, -1), F.softmax(t / T, -1), reduction="batchmean")
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def distill_kl_div_log_target(s, t, y, T, alpha):
    soft = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), reduction="batchmean")
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def distill_soft_hard_term(s, t, y, T, alpha):
    soft = kl(F.log_softmax(t / T, -1), F.log_softmax(s / T, -1)).mean()
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s / T, y)


def distill_soft_cross_entropy(s, t, y, T, alpha):
    p = F.softmax(t / T, -1)
    soft = -(p * F.log_softmax(s / T, -1)).sum(-1).mean()
    return alpha * T**2 * soft + (1 - alpha) * F.cross_entropy(s, y)


def test_distillation_loss_passes_right_answers():
    assert ch08.check_distillation_loss(distill).status == "passed"
    assert ch08.check_distillation_loss(distill_with_torch_kl_div).status == "passed"


@pytest.mark.parametrize(
    "answer, message",
    [
        (distill_no_t_squared, r"multiply the soft term by T\^2"),
        (distill_reversed_kl, "weight the log-ratio by the TEACHER's probabilities"),
        (distill_kl_div_mean, "use 'batchmean'"),
        (distill_hard_teacher, "divide the teacher's logits by T"),
        (distill_swapped_alpha, "alpha weights the SOFT term"),
        (distill_detached_student, "the gradient for the student logits is not"),
        (distill_kl_div_sum, "reduction='sum' sums over the samples too"),
        (distill_kl_div_of_probabilities, "LOG-probabilities as its first argument"),
        (distill_kl_div_log_target, "log_target=True"),
        (distill_soft_hard_term, "plain logits"),
        (distill_soft_cross_entropy, "the teacher's entropy"),
        (lambda s, t, y, T, a: F.cross_entropy(s, y, reduction="none"), "one-element tensor"),
    ],
)
@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")  # the planted kl_div bug
def test_distillation_loss_catches_planted_bugs(answer, message):
    with pytest.raises(ExerciseFailed, match=message):
        ch08.check_distillation_loss(answer)


def test_unanswered_exercises_are_not_attempted():
    assert ch08.check_freeze_first(unanswered).status == "not attempted"
    assert ch08.check_energy_rank(unanswered).status == "not attempted"
    assert ch08.check_distillation_loss(unanswered).status == "not attempted"


def test_a_crashing_answer_names_the_exercise_input():
    with pytest.raises(ExerciseFailed, match="your energy_rank on diag.*raised ZeroDivisionError"):
        ch08.check_energy_rank(lambda w, keep: 1 / 0)


# Answers that only call the library: test_back_doors.py sees each rejected.
DELEGATING_ANSWERS = {
    "freeze_first": lambda layers, k: freezing.freeze_first(layers, k),
    "energy_rank": lambda weight, keep: lowrank.energy_rank(weight, keep),
    "distillation_loss": lambda s, t, y, T, alpha: distillation.distillation_loss(
        s, t, y, T, alpha
    ),
}


def test_an_answer_that_freezes_through_freeze_is_rejected():
    with pytest.raises(ExerciseFailed, match="freezing.freeze is switched off"):
        ch08.check_freeze_first(lambda layers, k: freezing.freeze(layers, range(k)))


def test_an_answer_built_on_soft_target_loss_is_rejected():
    def answer(s, t, y, T, alpha):
        return alpha * distillation.soft_target_loss(s, t, T) + (1 - alpha) * F.cross_entropy(s, y)

    with pytest.raises(ExerciseFailed, match="soft_target_loss is switched off"):
        ch08.check_distillation_loss(answer)
