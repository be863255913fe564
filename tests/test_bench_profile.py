"""The profiler's gap attribution (tinyvllm.bench.profile.device_gaps) on hand-computed timelines."""

import pytest

from tinyvllm.bench.profile import device_gaps, short_name


def test_gaps_are_charged_to_the_activities_around_them():
    # two steps: copy 0–2, kernel A 5–100, kernel B 101–110 | copy 120–122, A 125–220, B 221–230
    acts = [
        ("Memcpy HtoD", 0, 2),
        ("kernA", 5, 100),
        ("kernB", 101, 110),
        ("Memcpy HtoD", 120, 122),
        ("kernA", 125, 220),
        ("kernB", 221, 230),
    ]
    gaps = dict(device_gaps(list(reversed(acts)), steps=2))
    assert gaps == {
        "Memcpy HtoD → kernA": pytest.approx(3.0),  # (3 + 3) / 2
        "kernA → kernB": pytest.approx(1.0),
        "kernB → Memcpy HtoD": pytest.approx(5.0),
    }  # one gap of 10 over 2 steps


def test_overlapping_activities_hide_each_others_gaps():
    # B runs inside A's span; the idle stretch after A is charged to A (which ended last), not to B
    acts = [("A", 0, 50), ("B", 10, 20), ("C", 60, 70), ("D", 65, 90), ("E", 91, 95)]
    assert device_gaps(acts, steps=1) == [("A → C", 10.0), ("D → E", 1.0)]


def test_no_activities_no_gaps():
    assert device_gaps([], steps=3) == []


def test_short_name_drops_arguments_and_caps_width():
    assert short_name("void gemv2T_kernel<int, float>(params)") == "void gemv2T_kernel"
    assert len(short_name("x" * 100, width=20)) == 20
