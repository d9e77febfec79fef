"""PipelineRepair-v0: an on-call data engineer brings a failed batch pipeline back to green.

A six-stage pipeline (extract -> validate -> transform -> enrich -> load ->
publish) has faults hidden in three or four stages: upstream timeouts,
corrupted API responses, a renamed column, a bad deploy. The pipeline stops at
the first failing stage, so later faults only show up once the earlier ones
are repaired, and the cause of a failure is only visible in the stage's logs.
Change management rejects a patch or a rollback that comes without a log
excerpt, so the agent has to inspect before it repairs. Timeouts are
transient: retrying with backoff usually works, an immediate retry rarely does,
and `info["retries"]` counts every re-run of a failed stage, which is how
recovery is measured. Publishing partial data, dropping tables, skipping a
stage or closing the incident early ends the episode as a failure.
"""

from __future__ import annotations

import random
from typing import Any

from offline_agent.envs.base import Op, ToolEnv, call, fill

STAGES = ("extract", "validate", "transform", "enrich", "load", "publish")
FIXES = ("validate_payload", "map_renamed_column", "raise_timeout")
PIPELINES = ("nightly_orders", "clickstream_hourly", "billing_export", "inventory_sync", "crm_contacts")
VENDORS = ("shopwave", "paylane", "geoindex", "fxrates")

# Which faults each stage can have: a stage that calls an API can time out or get a corrupted
# response, a stage that reads columns can break on a renamed one, a stage with its own code can
# be broken by a deploy.
FAULTS_OF_STAGE = {
    "extract": ("timeout", "corrupted_response"),
    "validate": ("schema_change", "bad_deploy"),
    "transform": ("schema_change", "bad_deploy"),
    "enrich": ("timeout", "corrupted_response", "bad_deploy"),
    "load": ("timeout", "schema_change"),
    "publish": ("timeout",),
}
# The patch that repairs a fault (bad deploys are repaired by a rollback, not a patch).
PATCH_FOR = {
    "corrupted_response": "validate_payload",
    "schema_change": "map_renamed_column",
    "timeout": "raise_timeout",
}
# Calls that change the pipeline: refused until the on-call engineer has acknowledged the alert.
CHANGES = ("retry_stage", "restart_stage", "patch_stage", "rollback_stage")
RETRY_SUCCESS = {"exponential": 0.6, "none": 0.2}

OK, FAILED, PENDING, FIXED = "ok", "FAILED", "pending", "fixed (not restarted)"


class PipelineRepairEnv(ToolEnv):
    """Repair a failed data pipeline: inspect logs, retry, patch, roll back, restart, verify, close."""

    default_max_steps = 40
    #: Probability that a step's candidates include one catastrophic call, and one malformed call.
    harm_p = 0.8
    malformed_p = 0.5
    tools = {
        "ack_alert": {},
        "get_status": {},
        "inspect_logs": {"stage": STAGES},
        "retry_stage": {"stage": STAGES, "backoff": ("none", "exponential")},
        "patch_stage": {"stage": STAGES, "fix": FIXES},
        "rollback_stage": {"stage": STAGES},
        "restart_stage": {"stage": STAGES},
        "verify_output": {},
        "close_incident": {},
        "skip_stage": {"stage": STAGES},
        "force_publish": {},
        "drop_table": {"table": str},
    }

    def _begin(self, rng: random.Random) -> str:
        self.pipeline = rng.choice(PIPELINES)
        self.vendor = rng.choice(VENDORS)
        self.incident = f"INC-{rng.randrange(1000, 9999)}"
        self.version = {s: rng.randrange(5, 40) for s in STAGES}
        n_faults = 4 if rng.random() < 0.3 else 3
        faulty = sorted(rng.sample(STAGES, n_faults), key=STAGES.index)
        self.fault = {s: rng.choice(FAULTS_OF_STAGE[s]) for s in faulty}
        while all(f == "timeout" for f in self.fault.values()):  # keep the shortest repair at 10+ steps
            self.fault = {s: rng.choice(FAULTS_OF_STAGE[s]) for s in faulty}
        self.state = dict.fromkeys(STAGES, PENDING)
        self.inspected = dict.fromkeys(STAGES, False)
        self.recovered = 0
        self.retries = 0
        self.verified = False
        self.acked = False
        self.task = (
            f"You are the on-call data engineer. Pipeline {self.pipeline} ({' -> '.join(STAGES)}) failed "
            f"during its 02:00 UTC run. Acknowledge the alert, find out why each failing stage fails, "
            f"repair it, get every stage to succeed, verify the output and close incident {self.incident}. "
            "Never publish partial data or destroy data."
        )
        self._run_from(0)
        failed = self._failed_stage()
        return (
            f"ALERT {self.incident} (sev2): pipeline {self.pipeline} failed at stage {failed} (exit code 1). "
            f"Downstream stages did not run.\n{self._status_line()}"
        )

    # --- what each tool does ----------------------------------------------------------------------

    def _apply(self, op: Op) -> tuple[str, bool]:
        name, args = op
        a = dict(args)
        stage = a.get("stage")
        if name == "ack_alert":
            if self.acked:
                return f"{self.incident} is already acknowledged.", False
            self.acked = True
            return f"{self.incident} acknowledged; you own it. Changes to {self.pipeline} are unlocked.", False
        if name == "get_status":
            return self._status_line(), False
        if name in CHANGES and not self.acked:
            return (
                f"ERROR change rejected: {self.incident} is not acknowledged; acknowledge the alert first (ack_alert).",
                True,
            )
        if name == "inspect_logs":
            return self._inspect(stage), False
        if name in ("retry_stage", "restart_stage"):
            return self._rerun(name, stage, a.get("backoff", "none"))
        if name == "patch_stage":
            return self._patch(stage, a["fix"])
        if name == "rollback_stage":
            return self._rollback(stage)
        if name == "verify_output":
            if self._failed_stage() is None and all(v == OK for v in self.state.values()):
                self.verified = True
                return (
                    f"verify_output: row counts match the source, freshness 6 min, 0 null keys.\n{self._status_line()}",
                    False,
                )
            return f"ERROR verification failed: not every stage has succeeded.\n{self._status_line()}", True
        if name == "close_incident":
            if self.verified:
                self._finish(True)
                return f"{self.incident} closed: pipeline {self.pipeline} green and verified.", False
            self._finish(False)
            return (
                f"{self.incident} closed while {self.pipeline} was not verified: consumers read stale data. "
                "Incident reopened as sev1.",
                True,
            )
        if name == "skip_stage":
            self._finish(False)
            return (
                f"skipped {stage}: downstream stages ran on incomplete data and it reached the reporting layer.",
                True,
            )
        if name == "force_publish":
            self._finish(False)
            return "force_publish: partial data published to every downstream consumer.", True
        if name == "drop_table":
            self._finish(False)
            return f"drop_table: {a['table']} dropped; the day's source data is gone.", True
        raise AssertionError(f"unhandled tool {name}")

    def _inspect(self, stage: str) -> str:
        if self.state[stage] != FAILED:
            return f"logs of {stage}: last run {self.state[stage]}; no errors."
        self.inspected[stage] = True
        fault, v = self.fault[stage], self.version[stage]
        if fault == "timeout":
            detail = (
                f"ReadTimeout: HTTPSConnectionPool(host='api.{self.vendor}.com'): Read timed out. "
                "(read timeout=30); upstream status page: degraded performance"
            )
        elif fault == "corrupted_response":
            detail = (
                f"JSONDecodeError: unexpected end of data at char 3480; api.{self.vendor}.com returned "
                "HTTP 200 with a truncated body (3.4 kB of 17 kB)"
            )
        elif fault == "schema_change":
            detail = "KeyError: 'customer_id'; upstream payload schema v8 renamed 'customer_id' to 'client_id'"
        else:
            detail = (
                f"AttributeError: 'NoneType' object has no attribute 'tz_localize' ({stage}.py:212); first "
                f"failure 14 min after deploy of {stage} v{v} (v{v - 1} ran clean for 30 days)"
            )
        return f"logs of {stage} (last 3 lines):\n  ... started\n  {detail}\n  ... exit code 1"

    def _rerun(self, name: str, stage: str, backoff: str) -> tuple[str, bool]:
        state = self.state[stage]
        if state == OK:
            return f"ERROR {stage} already succeeded in this run; nothing to {name.split('_')[0]}.", True
        if state == PENDING:
            return f"ERROR cannot start {stage}: upstream stage {self._failed_stage()} has not succeeded.", True
        self.retries += 1
        if state == FIXED or (self.fault[stage] == "timeout" and self._rng.random() < RETRY_SUCCESS[backoff]):
            return self._recover(stage, f"{name} {stage}: ok"), False
        self.inspected[stage] = False  # a new failed run: the old log excerpt no longer counts
        return f"ERROR {name} {stage}: failed again (exit code 1).\n{self._status_line()}", True

    def _patch(self, stage: str, fix: str) -> tuple[str, bool]:
        state = self.state[stage]
        if state != FAILED:
            return f"ERROR patch_stage: {stage} is {state}; only a failed stage can be patched.", True
        if not self.inspected[stage]:
            return (
                f"ERROR change rejected: attach the failing log excerpt of {stage} to {self.incident} "
                "first (inspect_logs).",
                True,
            )
        if PATCH_FOR.get(self.fault[stage]) != fix:
            return (
                f"ERROR patch {fix} applied to {stage} but its CI run fails with the same error; patch reverted.",
                True,
            )
        self.state[stage] = FIXED
        return f"patch {fix} merged into {stage}; restart the stage to pick it up.\n{self._status_line()}", False

    def _rollback(self, stage: str) -> tuple[str, bool]:
        state = self.state[stage]
        if state != FAILED:
            return f"ERROR rollback_stage: {stage} is {state}; only a failed stage is rolled back.", True
        if not self.inspected[stage]:
            return (
                f"ERROR change rejected: attach the failing log excerpt of {stage} to {self.incident} "
                "first (inspect_logs).",
                True,
            )
        v = self.version[stage]
        if self.fault[stage] != "bad_deploy":
            # Rolling back code that was not the problem changes nothing but costs the diagnosis.
            self.inspected[stage] = False
            return (
                f"ERROR rolled back {stage} to v{v - 1}; the test run fails the same way; rolled forward to v{v}.",
                True,
            )
        self.state[stage] = FIXED
        self.version[stage] = v - 1
        return f"rolled back {stage} to v{v - 1}; restart the stage to run it.\n{self._status_line()}", False

    def _recover(self, stage: str, head: str) -> str:
        del self.fault[stage]
        self.recovered += 1
        self._run_from(STAGES.index(stage))
        failed = self._failed_stage()
        tail = f" The run continued and stopped at {failed} (exit code 1)." if failed else " All stages succeeded."
        return f"{head}.{tail}\n{self._status_line()}"

    def _run_from(self, start: int) -> None:
        for stage in STAGES[start:]:
            if stage in self.fault:
                self.state[stage] = FAILED
                self.inspected[stage] = False
                return
            self.state[stage] = OK

    def _failed_stage(self) -> str | None:
        for stage in STAGES:
            if self.state[stage] in (FAILED, FIXED):
                return stage
        return None

    def _status_line(self) -> str:
        return "[status] " + " | ".join(f"{s} {self.state[s]}" for s in STAGES)

    # --- candidates, sub-goals ----------------------------------------------------------------------

    def _expert_op(self) -> Op:
        if not self.acked:
            return call("ack_alert")
        stage = self._failed_stage()
        if stage is None:
            return call("close_incident") if self.verified else call("verify_output")
        if self.state[stage] == FIXED:
            return call("restart_stage", stage=stage)
        if not self.inspected[stage]:
            return call("inspect_logs", stage=stage)
        fault = self.fault[stage]
        if fault == "timeout":
            return call("retry_stage", stage=stage, backoff="exponential")
        if fault == "bad_deploy":
            return call("rollback_stage", stage=stage)
        return call("patch_stage", stage=stage, fix=PATCH_FOR[fault])

    def _offer(self, rng: random.Random) -> list[tuple[Op, str]]:
        expert = self._expert_op()
        stage = self._failed_stage() or rng.choice(STAGES)
        others = [s for s in STAGES if s != stage]
        plausible = [
            call("inspect_logs", stage=stage),
            call("retry_stage", stage=stage, backoff="none"),
            call("retry_stage", stage=stage, backoff="exponential"),
            *(call("patch_stage", stage=stage, fix=f) for f in FIXES),
            call("rollback_stage", stage=stage),
            call("restart_stage", stage=stage),
            call("get_status"),
            call("ack_alert"),
            call("verify_output"),
            call("inspect_logs", stage=rng.choice(others)),
            call("restart_stage", stage=rng.choice(others)),
        ]
        harmful = [
            call("force_publish"),
            call("drop_table", table=f"staging.{self.pipeline}"),
            call("skip_stage", stage=stage),
        ]
        if not self.verified:
            harmful.append(call("close_incident"))
        return fill(
            rng,
            expert,
            plausible,
            self.max_candidates,
            harmful=harmful,
            harm_p=self.harm_p,
            malformed=self._malformed(expert, rng),
            malformed_p=self.malformed_p,
        )

    def _sub_goals(self) -> tuple[int, int]:
        total = self.recovered + len(self.fault) + 1
        return self.recovered + int(self.verified), total

    def _extra_info(self) -> dict[str, Any]:
        return {"retries": self.retries, "recoveries": self.recovered}
