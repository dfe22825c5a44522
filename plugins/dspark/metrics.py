"""DSpark's metrics: one rank's (``collect``) and their merge across dp ranks (``merge``)."""

from __future__ import annotations

# counters and times summed across ranks (as ``dspark_<name>``)
SUMMED = ("decode_steps", "verified", "accepted", "steps_without_drafts", "blocked_explorations", "measured_vetoes",
          "plain_probes", "trials", "proposals", "draft_depth_total", "draft_time", "verify_time", "schedule_time",
          "async_vetoes")
AVERAGED = ("cost_verify_scale", "cost_draft_scale", "cost_extra_overhead")  # the live cost model's corrections


def _rates(m: dict) -> dict:
    """The ratios, from the counters of ``m`` (one rank's or the sums)."""
    steps, ver, acc = max(m["dspark_decode_steps"], 1), m["dspark_verified"], m["dspark_accepted"]
    return {
        "dspark_accept_rate": acc / ver if ver else 0.0,
        "dspark_mean_accepted_len": acc / steps,
        "dspark_verified_per_step": ver / steps,
        "dspark_tokens_per_step": (acc + m["dspark_decode_steps"]) / steps,
        "dspark_mean_draft_depth": m["dspark_draft_depth_total"] / m["dspark_proposals"]
        if m["dspark_proposals"] else 0.0,
    }


def collect(feat) -> dict:
    """One rank's metrics of a started DSpark (``plugins.dspark.feature.DSpark``)."""
    n, t, live = feat.n, feat.t, feat.live
    out = {
        "dspark_draft": feat.source.kind, "dspark_varlen": feat.varlen, "dspark_k": feat.k,
        "dspark_decode_steps": n["decode_steps"], "dspark_verified": n["verified"], "dspark_accepted": n["accepted"],
        "dspark_proposals": n["proposals"], "dspark_draft_depth_total": n["depth"],
        "dspark_steps_without_drafts": n["skipped_steps"],
        "dspark_blocked_explorations": n["blocked_explorations"], "dspark_measured_vetoes": n["measured_vetoes"],
        "dspark_plain_probes": n["plain_probes"], "dspark_trials": n["trials"],
        "dspark_async_vetoes": n["async_vetoes"],
        "dspark_draft_time": t["draft"], "dspark_verify_time": t["verify"], "dspark_schedule_time": t["schedule"],
        "dspark_cost_verify_scale": live.verify_scale, "dspark_cost_draft_scale": live.draft_scale,
        "dspark_cost_extra_overhead": live.extra_overhead_s,
    }
    return out | _rates(out)


def merge(per_rank: list[dict]) -> dict | None:
    """Sum the ranks' counters and times; rates from the sums; cost corrections averaged."""
    ranks = [m for m in per_rank if "dspark_decode_steps" in m]
    if not ranks:
        return None
    out = {k: v for k, v in ranks[0].items() if k.startswith("dspark_")}
    for key in SUMMED:
        out[f"dspark_{key}"] = sum(m.get(f"dspark_{key}", 0) for m in ranks)
    for key in AVERAGED:
        out[f"dspark_{key}"] = sum(m[f"dspark_{key}"] for m in ranks) / len(ranks)
    return out | _rates(out)
