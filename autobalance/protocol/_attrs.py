"""The names under which a study keeps what autobalance records: study attributes (set once per
study) and trial attributes (set on every trial). Readers (report, CLI views, production loading)
use these, never the literal strings."""

from __future__ import annotations

__all__ = ["CONSTRAINTS_KEY", "StudyAttr", "TrialAttr"]

CONSTRAINTS_KEY = "constraints"
"""Optuna's (legacy) trial system attribute for constraint values: read by every sampler and by
optuna-dashboard; ``<= 0`` everywhere means feasible."""


class StudyAttr:
    """Study user attributes."""

    SPACE = "autobalance:space"
    """The search space (``SearchSpace.to_dict``), fixed by the baseline trial."""
    OBJECTIVE = "autobalance:objective"
    """Objective settings (weights, headroom, caps, device, world size, ...): a continued study must match."""
    REFERENCE = "autobalance:reference_step_s"
    """The reference step time, seconds: every trial's step time is divided by it in the objective.
    Fixed before the search: the baseline's step, else the step of a reference run of the script's
    own configuration with every block checkpointed (several ranks); else, and in studies stored
    before :attr:`EXCHANGE_RATE`, the first measured trial's."""
    EXCHANGE_RATE = "autobalance:exchange_rate"
    """The objective's trade between spread and step time: ``reference_step_s``, ``source``
    (``baseline``, ``reference``, ``first-measured``), ``trial`` (the trial that measured it),
    ``weight_spread``, ``weight_time``, ``world_size``, ``capacity_bytes`` (per rank, what the spread
    is a fraction of); ``protocol.exchange_rate_text`` says it in
    words. Absent in studies stored before it (read from :attr:`REFERENCE` then)."""
    BASELINE = "autobalance:baseline_trial"
    """Number of the baseline trial (the script's own configuration)."""
    CAPACITY = "autobalance:capacity_bytes"
    """Per-rank device capacity seen by the baseline (the device's own memory, not an emulated cap)."""
    CAPACITY_IN_WORDS = "autobalance:capacity_in_words"
    """What :attr:`CAPACITY` is next to the limit trials are judged against (an emulated cap, or the
    device's memory), in words with units: the dashboard lists it beside ``capacity_bytes``."""
    DEVICE = "autobalance:device"
    """The baseline's rank-0 device section."""
    MODEL = "autobalance:model"
    """The baseline's rank-0 model facts (``RankReport.model``: blocks, ``loss_in_model``, framework)."""
    DEVICE_NAMES = "autobalance:device_names"
    """Each rank's device identity in the baseline (``RankDevice.identity``; None where a rank reported
    none): the saved fingerprint's ``device_names``, which production maps the configuration by."""
    SCRIPT_SHA = "autobalance:script_sha256"
    LAUNCH = "autobalance:launch"
    """How the latest ``tune`` ran the script (path, arguments, ranks, runs dir): what ``promote`` needs
    to verify a trial without being told again."""
    SCRIPT_FACTS = "autobalance:script_facts"
    """What the baseline's report says about the script, in words (shown again in the summary)."""
    TORCH_VERSION = "autobalance:torch_version"
    CUDA_VERSION = "autobalance:cuda_version"
    COMPILE_TOTAL = "autobalance:compile_total_s"
    """Seconds spent compiling over the study."""
    MEMORY_MODEL_ERROR = "autobalance:memory_model_holdout_error"
    TIME_SPENT = "autobalance:time_spent"
    """How the latest ``tune`` run spent its wall time, in seconds: ``wall`` (the run, verification
    included), the launched trials' ``compile``, ``startup``, ``steps``, ``remeasure`` and ``handover``,
    ``verify`` (``verified``: whether verification ran), ``other`` (``wall`` less compile, start-up,
    steps, re-measuring and verification); its ``slots``; its time budget (``budget_s``,
    ``stopped_by_budget``, ``trials`` counted of ``of``)."""
    COMPILED_MODEL_ERROR = "autobalance:compiled_model_holdout_error"
    """Leave-one-trial-out mean relative error of the compiled model's per-rank peaks."""
    MODEL_ERRORS = "autobalance:model_errors"
    """The last fits the search survived by falling back: ``[{"where": ..., "error": ...}]`` (bounded)."""
    BASELINE_CLAIM = "autobalance:baseline_claim"
    """Which worker runs the baseline (concurrent workers on one study)."""
    RUNNING_CLAIM_PREFIX = "autobalance:running:"
    """A system attribute per configuration being launched (``<prefix><sha1 of its JSON>``, value the
    trial id): the atomic claim that keeps two workers from launching one configuration at once."""
    ALLOW_BATCH_DEPENDENT = "autobalance:allow_batch_dependent"
    """True when the study was tuned with ``--allow-batch-dependent`` (verified in eval mode)."""
    VERIFY_PREFIX = "autobalance:verify:"
    """``+ <trial number>``: the verdict of verifying that trial's configuration."""
    LEADERS = "autobalance:leaders"
    """The leaders re-measured before saving (``tuner/_remeasure.py``): ``{"reason": ..., "order": [trial
    numbers, best first], "trials": {"<number>": {"value": pooled objective value, "step_time_ms",
    "q1_ms", "q3_ms", "steps", "runs"} or {"failed": reason}}}``. Read by ``protocol.ranked_trials``: a
    leader ranks by its pooled value."""


class TrialAttr:
    """Trial user attributes (the per-rank figures are listed in the tuner's ``TrialFigures.user_attrs``)."""

    STATUS = "status"
    """A :class:`~autobalance.protocol.Status` value."""
    REASON = "reason"
    """One line saying why (the failing rank and what happened)."""
    CONFIG = "config"
    """The trial's ``BalanceConfig.to_dict()``."""
    SPLIT = "split"
    """The trial's micro-batches per rank as people read them, one string (``BalanceConfig.split_text()``:
    ``rank 0: 6,6,5,5,5,5; rank 1: 4,4,4,3,3,3``; optuna-dashboard shows a string as it is, a list
    as JSON), for the dashboard; display only (studies from before hold ``split_lines()``, a list)."""
    BASELINE = "baseline"
    """True on the baseline trial."""
    REFERENCE_RUN = "reference_run"
    """True on a reference run: on several ranks, when the baseline gave no step time, the script's own
    configuration with every block checkpointed, run before the search to fix the reference step."""
    FEASIBLE = "feasible"
    OUTCOME = "outcome"
    """What became of the trial in a few words (``ok``, ``over limit (rank 0)``, ``OOM (rank 1)``,
    ``predicted OOM (not run)``): told apart at a glance in optuna-dashboard."""
    REUSED_FROM = "reused_from"
    """Number of the trial whose measurement was reused (a repeated configuration)."""
    PREDICTED_BY = "predicted_by"
    TRIAL_DIR = "trial_dir"
    WALL_S = "wall_s"
    TIME_IN_STEPS_S = "time_in_steps_s"
    """Seconds the slowest rank spent in warm-up and measured steps (compilation excluded); read it
    with :func:`~autobalance.protocol.time_in_steps_s` (studies from before hold ``STEPS_S_BEFORE``)."""
    STEPS_S_BEFORE = "steps_s"
    """The name ``TIME_IN_STEPS_S`` had before (it read like steps per second): read, never written."""
    STEP_TIME_MS = "step_time_ms"
    BUSY_MS = "busy_ms"
    """Each rank's busy time per step in ms (its own work, without its wait at the all-reduce;
    ``RankReport.busy_time_s``); None where a rank reported none."""
    WAIT_MS = "allreduce_wait_ms"
    """Each rank's wait at the step's gradient all-reduce in ms (``RankReport.allreduce_wait_s``)."""
    MEASURED_STEPS = "measured_steps"
    SPREAD_GIB = "spread_gib"
    COMPILE_S = "compile_s"
    COMPILE_CACHE = "compile_cache"
    PARAMETER_BYTES = "parameter_bytes"
    """The model's parameter bytes as the runtime saw them (what a verification run saves and loads)."""
    HELD_GIB = "held_gib"
    """Per rank: GiB live after an optimizer step plus outside PyTorch (what does not scale with the
    micro-batch; ``TrialFigures.held``); absent when not measured."""
    PROPOSAL_PHASE = "proposed_by"
    """The search-policy phase that proposed the trial (``tuner/search/_policy.py``; ``sampler``: Optuna's)."""
    PROPOSAL_REASON = "proposal_note"
    """Why that phase proposed it, in words."""
    POOL_START_S = "pool_start_s"
    WARM_RECYCLED = "warm_recycled"
    """Why the warm pool was restarted after the trial (its worker held more than a fresh one: a
    compiled trial's kernels); absent when the pool went on."""
    DROPOUT_MODULES = "dropout_modules"
    """The most dropout layers with ``p > 0`` any rank's model had (``RankReport.model``; absent: not
    reported): verification's dropout runs are launched only for a model with dropout."""
    TIME_SPLIT = "time_split_s"
    """A launched trial's wall time by part, in seconds: ``startup`` (launch to the first step, a warm
    pool's start included), ``compile``, ``steps`` (warm-up and measured), ``remeasure`` (a second
    run) and ``other`` (after the last step: the report, the hand-over)."""
    PEAK_DEVICE_GIB = "peak_device_gib"
    OPTIMIZER_STATE_BYTES = "optimizer_state_bytes"
    """Each rank's measured optimizer-state bytes (``RankReport.optimizer.state_bytes``; zero1: its share)."""
    OPTIMIZER_WRAPPED = "optimizer_wrapped"
    """The script passes its optimizer through ``plan.optimizer`` (so ``zero1`` can be searched)."""
    USABLE_GIB = "usable_gib"
    CAPACITY_GIB = "capacity_gib"
    """Each rank's capacity in GiB (the emulated cap, else the device's)."""
    SPREAD_PCT = "spread_pct_of_capacity"
    STEP_IQR_PCT = "step_time_iqr_pct"
    """The worst rank's step-time IQR, % of its median."""
    PREDICTED = "predicted"
    """True on a trial recorded without launching (judged out of memory)."""
    FAILING_RANK = "failing_rank"
    ERROR_TAIL = "error_tail"
