"""`pdserve launch`'s pure parts: flag routing, the token kept off command lines, restart back-off."""

from __future__ import annotations

from common.launcher import TOKEN_ENV, Backoff, _without, child_env, split_extra_args


def test_flags_reach_the_roles_that_know_them() -> None:
    per_role = split_extra_args(["--api-key", "k1", "--auth-token=t", "--schedule-policy", "lpm"])
    assert per_role["bootstrap"] == ["--api-key", "k1", "--auth-token=t"]
    assert per_role["prefill"] == ["--auth-token=t", "--schedule-policy", "lpm"]
    assert per_role["decode"] == ["--auth-token=t"]


def test_the_token_goes_by_environment_never_argv() -> None:
    assert _without(["--auth-token", "s", "--x", "1", "--auth-token=s2"], "--auth-token") == [
        "--x", "1"
    ]
    assert child_env("s3cret")[TOKEN_ENV] == "s3cret"


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run() -> None:
    b = Backoff(first_s=1, max_s=30, stable_s=60)
    assert [b.delay_after_exit(ran_s=2) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert b.delay_after_exit(ran_s=61) == 1  # it ran long enough: a fresh start
    assert b.delay_after_exit(ran_s=1) == 2


def test_help_lists_every_flag_launch_passes_on_with_its_roles() -> None:
    from common.launcher import build_parser

    text = build_parser().format_help()
    for flag, roles in (("--schedule-policy", "[prefill]"),
                        ("--disaggregation-bootstrap-port", "[bootstrap,prefill,decode]"),
                        ("--retraction-policy", "[decode]"), ("--api-key", "[bootstrap]"),
                        ("--dtype", "[prefill,decode]")):
        line = next((x for x in text.splitlines() if x.strip().startswith(flag + " ")), "")
        assert roles in line, (flag, line)
    # Flags launch owns itself are not listed as passed on.
    passed_on = text.split("flags passed on", 1)[1]
    assert "  --model-path " not in passed_on and "  --port " not in passed_on
