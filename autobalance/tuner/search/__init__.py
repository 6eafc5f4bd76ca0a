"""The search: what the study looks for and how it looks.

- ``_constants``: every constant the search and the time budget decide by, with its measurement;
- ``_space``: the search space (micro-batch shares, accumulation, checkpointing, dtype, buckets, compile);
- ``_objective``: from a trial's rank reports to its figures, objective values and memory constraint;
- ``_memory_model``: per-rank peak memory, fitted from the study's trials;
- ``_timing``: the timing model: step time eager and compiled, compile time per scope, a trial's
  time, verification's price, fitted from the study's own trials;
- ``_solver``: balanced splits and per-rank checkpointing from the memory model;
- ``_holdout``: what the memory models are fitted from, and their leave-one-trial-out errors;
- ``_compiled_model``: compiled configurations' peaks (per-rank budgets);
- ``_candidates``: the models' proposals, eager from the memory model and compiled from the compiled model
  (ordered to reuse the Inductor cache);
- ``_dominance``: what cannot fit, said before launching (model-free dominance, the memory models' vetoes);
- ``_first_trials``: on a GPU, which dtypes the models may propose (bf16 first) and when the sampler explores;
- ``_model_errors``: the errors a fit can raise, and the ones the search fell back from (kept in the study);
- ``_models``: the models of one decision, the candidates they rank, what the policy's phases ask of them;
- ``_advisor``: the ``model`` strategy's glue to Optuna: enqueue the policy's proposal, veto, learn after each trial.

Nothing here launches a trial; the study's running side (``autobalance.tuner``) uses these.
"""

from __future__ import annotations

from autobalance.tuner.search._advisor import (
    ModelAdvisor,
    observations_from_trials,
)
from autobalance.tuner.search._candidates import (
    CACHE_TIE,
    Candidate,
    cache_order,
    compiled_candidates,
)
from autobalance.tuner.search._compiled_model import (
    UNMEASURED_MARGIN,
    BudgetCurve,
    CompiledMemoryModel,
    CompiledObservation,
    budget_grid,
    compiled_observations,
)
from autobalance.tuner.search._constants import (
    AUTO_MEASURE_FACTOR,
    AUTO_MEASURE_MAX_S,
    BUDGET_CEILING,
    COMPARE_S_PER_GB,
    DISPERSION_LIMIT,
    DTYPE_SPEED_PRIOR,
    EAGER_FIRST,
    EQUAL_SPEED_BAND,
    FIRST_STEP_FACTOR,
    FIT_MARGIN,
    FLOOR_RUNS,
    FROM_CACHE_SHARE,
    GROW_MIN_BUDGET,
    IMPROVES,
    IO_S_PER_GB,
    KEEP_AT_FULL_BUDGET,
    MAX_CANDIDATES,
    MAX_CRASHES_IN_A_ROW,
    MAX_ERROR_TEXT,
    MAX_KEPT_ERRORS,
    MAX_PREDICTED_IN_A_ROW,
    NEIGHBOUR_RANKS,
    REGIONAL_COMPILE_SHARE,
    RESERVE_MARGIN,
    SAMPLER_EVERY,
    SCOPE_TRANSFERS,
    SHARE_TOL,
    SLOW_DTYPE,
    STALL_AFTER,
    WARM_PRUNE_MIN_STEPS,
    WORTH,
)
from autobalance.tuner.search._cuda_graphs import GRAPH_GAIN, graph_probe, graphs_verdict
from autobalance.tuner.search._dominance import (
    activation_budget,
    dominating_over_cap,
)
from autobalance.tuner.search._first_trials import (
    proposable_dtypes,
    proposals_stalled,
)
from autobalance.tuner.search._memory_model import (
    ACTIVATION_BYTES_SCALE,
    DEFAULT_SAFETY_MARGIN,
    PRIOR_CHECKPOINT_SAVING,
    DtypeFit,
    MemoryModel,
    MemoryObservation,
)
from autobalance.tuner.search._model_errors import (
    FIT_ERRORS,
    ModelErrors,
    model_errors_line,
)
from autobalance.tuner.search._objective import (
    INFEASIBLE_TIME,
    TrialFigures,
    compile_figures,
    figures_from_outcome,
    fix_exchange_rate,
    penalised,
    rate_fixed,
    rate_source,
    spread_fraction,
)
from autobalance.tuner.search._policy import (
    LOW_BUDGET,
    Proposal,
    SearchPolicy,
    TrialHistory,
    proposal_line,
)
from autobalance.tuner.search._sharding import SavingModel, ShardingFacts
from autobalance.tuner.search._snapshot import Decision
from autobalance.tuner.search._solver import (
    DEFAULT_RECOMPUTE_FRACTION,
    SplitPlan,
    balanced_split,
    balanced_split_for,
    choose_checkpointing,
    plans_from_model,
    predict_config_feasible,
    predict_feasible,
)
from autobalance.tuner.search._space import (
    BUDGET_RANGE,
    SHARE_RANGE,
    SearchSpace,
    compile_key,
    config_compile_key,
    space_problem,
)
from autobalance.tuner.search._timing import (
    CACHE_HIT_PRIOR_S,
    COMPILE_PRIOR_S,
    COMPILE_SPEED_PRIOR,
    DYNAMIC,
    MICRO_STEP_PRIOR,
    RECOMPUTE_PRIOR,
    RECOMPUTE_PRIOR_COMPILED,
    CompiledTimeModel,
    RunPrices,
    StepTimeModel,
    VerifyForecast,
    cache_dir,
    compile_env,
    compile_notes,
    compile_times,
    compiled_graphs,
    forecast_verification,
    graph_keys,
    has_dropout,
    next_trial_s,
    per_trial_overhead_s,
    restarts,
    run_prices,
    trial_s,
    verification_runs,
    worker_start_s,
)

__all__ = [
    "ACTIVATION_BYTES_SCALE",
    "AUTO_MEASURE_FACTOR",
    "AUTO_MEASURE_MAX_S",
    "BUDGET_CEILING",
    "BUDGET_RANGE",
    "CACHE_HIT_PRIOR_S",
    "CACHE_TIE",
    "COMPARE_S_PER_GB",
    "COMPILE_PRIOR_S",
    "COMPILE_SPEED_PRIOR",
    "DEFAULT_RECOMPUTE_FRACTION",
    "DEFAULT_SAFETY_MARGIN",
    "DISPERSION_LIMIT",
    "DTYPE_SPEED_PRIOR",
    "DYNAMIC",
    "EAGER_FIRST",
    "EQUAL_SPEED_BAND",
    "FIRST_STEP_FACTOR",
    "FIT_ERRORS",
    "FIT_MARGIN",
    "FLOOR_RUNS",
    "FROM_CACHE_SHARE",
    "GRAPH_GAIN",
    "GROW_MIN_BUDGET",
    "IMPROVES",
    "INFEASIBLE_TIME",
    "IO_S_PER_GB",
    "KEEP_AT_FULL_BUDGET",
    "LOW_BUDGET",
    "MAX_CANDIDATES",
    "MAX_CRASHES_IN_A_ROW",
    "MAX_ERROR_TEXT",
    "MAX_KEPT_ERRORS",
    "MAX_PREDICTED_IN_A_ROW",
    "MICRO_STEP_PRIOR",
    "NEIGHBOUR_RANKS",
    "PRIOR_CHECKPOINT_SAVING",
    "RECOMPUTE_PRIOR",
    "RECOMPUTE_PRIOR_COMPILED",
    "REGIONAL_COMPILE_SHARE",
    "RESERVE_MARGIN",
    "SAMPLER_EVERY",
    "SCOPE_TRANSFERS",
    "SHARE_RANGE",
    "SHARE_TOL",
    "SLOW_DTYPE",
    "STALL_AFTER",
    "UNMEASURED_MARGIN",
    "WARM_PRUNE_MIN_STEPS",
    "WORTH",
    "BudgetCurve",
    "Candidate",
    "CompiledMemoryModel",
    "CompiledObservation",
    "CompiledTimeModel",
    "Decision",
    "DtypeFit",
    "MemoryModel",
    "MemoryObservation",
    "ModelAdvisor",
    "ModelErrors",
    "Proposal",
    "RunPrices",
    "SavingModel",
    "SearchPolicy",
    "SearchSpace",
    "ShardingFacts",
    "SplitPlan",
    "StepTimeModel",
    "TrialFigures",
    "TrialHistory",
    "VerifyForecast",
    "activation_budget",
    "balanced_split",
    "balanced_split_for",
    "budget_grid",
    "cache_dir",
    "cache_order",
    "choose_checkpointing",
    "compile_env",
    "compile_figures",
    "compile_key",
    "compile_notes",
    "compile_times",
    "compiled_candidates",
    "compiled_graphs",
    "compiled_observations",
    "config_compile_key",
    "dominating_over_cap",
    "figures_from_outcome",
    "fix_exchange_rate",
    "forecast_verification",
    "graph_keys",
    "graph_probe",
    "graphs_verdict",
    "has_dropout",
    "model_errors_line",
    "next_trial_s",
    "observations_from_trials",
    "penalised",
    "per_trial_overhead_s",
    "plans_from_model",
    "predict_config_feasible",
    "predict_feasible",
    "proposable_dtypes",
    "proposal_line",
    "proposals_stalled",
    "rate_fixed",
    "rate_source",
    "restarts",
    "run_prices",
    "space_problem",
    "spread_fraction",
    "trial_s",
    "verification_runs",
    "worker_start_s",
]
