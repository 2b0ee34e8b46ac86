"""Cost figures: fitting the CPU line, the online refresh, and the profile stored beside a checkpoint."""

import json

import pytest

from kubemoe.frontend.offload.costs import (
    GROUPED_MIN_EXPERTS, PROFILE_FILE, CostLine, ExpertCosts, GroupSeconds, LineFit, OffloadProfile, ProfileRefresher, fit_line,
)


def make_profile(**changes) -> OffloadProfile:
    doc = dict(device="test GPU, PCIe 4.0", attn=CostLine(0.001, 0.2),
               experts=(ExpertCosts(1000, 2.0, CostLine(0.0, 0.5), CostLine(1.0, 1.0)),))
    doc.update(changes)
    return OffloadProfile(**doc)


def test_least_squares_recovers_beta_and_c():
    # t_c = 0.25 ms/token + 3 ms, sampled exactly and with symmetric noise that averages out.
    samples = [(n, 0.00025 * n + 0.003) for n in (1, 4, 16, 64)]
    line = fit_line(samples)
    assert line.slope == pytest.approx(0.00025) and line.intercept == pytest.approx(0.003)
    noisy = [(n, s + (1e-4 if i % 2 else -1e-4)) for i, (n, s) in enumerate(samples + samples[::-1])]
    assert fit_line(noisy).slope == pytest.approx(0.00025, rel=1e-6)


def test_a_fit_never_gives_negative_costs_and_needs_two_token_counts():
    # Points falling with tokens: the best non-negative line is flat at their mean.
    assert fit_line([(1, 3.0), (3, 1.0)]) == CostLine(0.0, 2.0)
    # Points through the origin's far side: the intercept is clamped and the slope refitted.
    line = fit_line([(10, 1.0), (20, 3.0)])
    assert line.intercept == 0.0 and line.slope == pytest.approx((10 * 1 + 20 * 3) / (100 + 400))
    with pytest.raises(ValueError, match="two or more different token counts"):
        fit_line([(8, 1.0), (8, 1.2)])


def test_exponentially_weighted_fit_follows_a_change():
    fit = LineFit(forget=0.5)
    for n in (1, 2, 3, 4):
        fit.add(n, 1.0 * n)
    for n in (1, 2, 3, 4) * 10:
        fit.add(n, 2.0 * n + 1.0)  # the machine got slower
    line = fit.line()
    assert line.slope == pytest.approx(2.0, rel=1e-3) and line.intercept == pytest.approx(1.0, rel=1e-2)


def test_refresher_moves_t_io_by_ema_and_keeps_a_line_until_it_can_fit_one():
    refresher = ProfileRefresher(make_profile(), alpha=0.25)
    refresher.observe_io(1000, 4.0)
    assert refresher.profile.costs(1000).t_io == pytest.approx(0.75 * 2.0 + 0.25 * 4.0)
    refresher.observe_attn(1, 1.0)
    refresher.observe_attn(3, 2.0)
    refresher.observe_gpu(1000, 1, 1.0)
    refresher.observe_gpu(1000, 2, 1.0)
    assert refresher.profile.attn.slope == pytest.approx(0.5) and refresher.profile.costs(1000).gpu == CostLine(0.0, 1.0)


def test_cpu_timings_scale_the_profiled_line_and_never_refit_its_slope():
    refresher = ProfileRefresher(make_profile(), alpha=0.25)  # t_c(n) = n + 1
    refresher.observe_cpu(1000, [(8, 27.0)])  # three times the profiled 9 s
    assert refresher.profile.costs(1000).cpu == CostLine(1.5, 1.5)  # scale 0.75 * 1 + 0.25 * 3
    for _ in range(60):  # decode: a few tokens each, 3x slower; a refit would make up a slope from these
        refresher.observe_cpu(1000, [(n, 3.0 * (n + 1)) for n in (1, 2)])
    line = refresher.profile.costs(1000).cpu
    assert line.slope == pytest.approx(3.0, rel=1e-3) and line.intercept == pytest.approx(3.0, rel=1e-3)
    assert refresher.profile.costs(1000).t_c(800) == pytest.approx(3.0 * 801, rel=1e-3)  # prefill priced alike


def test_profile_round_trips_through_the_checkpoint_folder(tmp_path):
    profile = make_profile()
    path = profile.save(tmp_path)
    assert path.name == PROFILE_FILE and json.loads(path.read_text())["device"] == "test GPU, PCIe 4.0"
    assert OffloadProfile.load(tmp_path) == profile
    with pytest.raises(FileNotFoundError, match="profile the checkpoint"):
        OffloadProfile.load(tmp_path / "elsewhere")


def test_experts_on_the_device_are_priced_as_the_executor_runs_them():
    costs = ExpertCosts(1000, 2.0, CostLine(0.0, 0.5), CostLine(1.0, 1.0), grouped=CostLine(0.01, 0.02))
    few, many = [1] * (GROUPED_MIN_EXPERTS - 1), [1] * GROUPED_MIN_EXPERTS
    assert not costs.groups(len(few)) and costs.t_g_all(few) == pytest.approx(0.5 * len(few))  # one FFN each
    assert costs.groups(len(many)) and costs.t_g_all(many) == pytest.approx(0.03 * len(many))  # one grouped FFN
    ungrouped = ExpertCosts(1000, 2.0, CostLine(0.0, 0.5), CostLine(1.0, 1.0))  # kernels that do not group
    assert not ungrouped.groups(100) and ungrouped.t_g_all(many) == pytest.approx(0.5 * len(many))


def test_a_grouped_line_round_trips_and_older_profiles_load_without_one(tmp_path):
    profile = make_profile(experts=(ExpertCosts(1000, 2.0, CostLine(0.0, 0.5), CostLine(1.0, 1.0),
                                                CostLine(0.01, 0.02)),))
    profile.save(tmp_path)
    assert OffloadProfile.load(tmp_path) == profile
    doc = make_profile().to_dict()
    del doc["experts"][0]["grouped"]  # written before the grouped line existed
    assert OffloadProfile.from_dict(doc).costs(1000).grouped is None


def test_unknown_expert_size_and_scaled_bandwidth():
    profile = make_profile()
    with pytest.raises(ValueError, match="no figures for 999-byte experts"):
        profile.costs(999)
    slow = profile.at_bandwidth(500.0, "pcie3")
    assert slow.costs(1000).t_io == 2.0 and slow.source == "modelled" and "pcie3" in slow.device
    assert slow.costs(1000).cpu == profile.costs(1000).cpu


def test_invalid_figures():
    with pytest.raises(ValueError):
        CostLine(-1.0, 0.0)
    with pytest.raises(ValueError, match="one entry per expert size"):
        make_profile(experts=())


def test_a_group_joined_one_expert_at_a_time_costs_what_it_costs_whole():
    costs = ExpertCosts(1000, 2.0, CostLine(0.0, 0.5), CostLine(1.0, 1.0), grouped=CostLine(0.01, 0.02))
    tokens = [5, 1, 3, 2, 8, 1]
    group = GroupSeconds(costs)
    grown = [group.join(a, s) for a, s in zip(costs.gpu.each(tokens), costs.shared_each(tokens))]
    # One FFN each below four experts; at the fourth the group becomes one grouped FFN and its time falls.
    assert grown[:3] == [0.5] * 3 and grown[3] == pytest.approx(costs.t_g_all(tokens[:4]) - 1.5) and grown[3] < 0
    assert group.seconds == pytest.approx(costs.t_g_all(tokens))
    assert GroupSeconds(costs, tokens).seconds == pytest.approx(costs.t_g_all(tokens))
