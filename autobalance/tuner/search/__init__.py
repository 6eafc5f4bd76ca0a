"""The search: what the study looks for and how it looks.

- ``_constants``: every constant the search and the time budget decide by, with its measurement;
- ``_space``: the search space (micro-batch shares, accumulation, checkpointing, dtype, buckets, compile);
- ``_objective``: from a trial's rank reports to its figures, objective values and memory constraint;
- ``_memory_model``: per-rank peak memory, fitted from the study's trials;
- ``_timing``: the timing model: step time eager and compiled, compile time per scope, a trial's
  time, verification's price, fitted from the study's own trials; the time budget (``TimeBudget``);
- ``_solver``: balanced splits and per-rank checkpointing from the memory model;
- ``_compiled_model``: compiled configurations' peaks (per-rank budgets);
- ``_dominance``: what cannot fit, said before launching (model-free dominance, the memory models' vetoes);
- ``_model_errors``: the errors a fit can raise, and the ones the search fell back from (kept in the study);
- ``_models``: one decision (``Decision``: the study read once, each model fitted at most once), the
  candidates the models rank, what the policy's phases ask of them; on a GPU which dtypes the models may
  propose (bf16 first) and when the sampler explores; CUDA graphs probed once (``--compile-mode auto``);
  what the memory models are fitted from, and their leave-one-trial-out errors;
- ``_policy``: where the next trial is chosen (the phases), and ``ModelAdvisor``, the ``model`` strategy's glue to
  Optuna: enqueue the policy's proposal, veto, learn after each trial.

Nothing here launches a trial; the study's running side (``autobalance.tuner``) uses these.
"""


from __future__ import annotations

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
    COMPARE_S_PER_GB,
    DISPERSION_LIMIT,
    FIRST_STEP_FACTOR,
    FIT_MARGIN,
    FROM_CACHE_SHARE,
    GROW_MIN_BUDGET,
    IO_S_PER_GB,
    KEEP_AT_FULL_BUDGET,
    LEADER_MEDIAN_SE,
    LEADER_NOISE_FLOOR,
    LEADER_NOISE_SIGMAS,
    LEADER_RUNS,
    LEADERS_MAX,
    MAX_CANDIDATES,
    MAX_CRASHES_IN_A_ROW,
    MAX_KEPT_ERRORS,
    MAX_PREDICTED_IN_A_ROW,
    REASON_CHARS,
    REGIONAL_COMPILE_SHARE,
    RESERVE_MARGIN,
    WARM_PRUNE_MIN_STEPS,
)
from autobalance.tuner.search._dominance import activation_budget, dominating_over_cap
from autobalance.tuner.search._memory_model import (
    DEFAULT_SAFETY_MARGIN,
    MemoryModel,
    MemoryObservation,
)
from autobalance.tuner.search._model_errors import ModelErrors, model_errors_line
from autobalance.tuner.search._models import (
    Candidate,
    Decision,
    cache_order,
    compiled_candidates,
    graph_probe,
    graphs_verdict,
    observations_from_trials,
    proposable_dtypes,
    proposals_stalled,
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
    ModelAdvisor,
    Proposal,
    SearchPolicy,
    TrialHistory,
    proposal_line,
)
from autobalance.tuner.search._sharding import SavingModel, ShardingFacts
from autobalance.tuner.search._solver import (
    SplitPlan,
    balanced_split,
    balanced_split_for,
    choose_checkpointing,
    plans_from_model,
    predict_config_feasible,
    predict_feasible,
)
from autobalance.tuner.search._space import SearchSpace, space_problem
from autobalance.tuner.search._timing import (
    CACHE_HIT_PRIOR_S,
    COMPILE_PRIOR_S,
    DYNAMIC,
    MICRO_STEP_PRIOR,
    RECOMPUTE_PRIOR,
    CompiledTimeModel,
    StepTimeModel,
    TimeBudget,
    cache_dir,
    compile_env,
    compile_notes,
    compile_times,
    compiled_graphs,
    forecast_verification,
    from_cache_s,
    graph_keys,
    next_trial_s,
    per_trial_overhead_s,
    restarts,
    trial_s,
    typical_compile_s,
    verification_runs,
    worker_start_s,
)

__all__ = ["AUTO_MEASURE_FACTOR", "AUTO_MEASURE_MAX_S", "CACHE_HIT_PRIOR_S", "COMPARE_S_PER_GB", "COMPILE_PRIOR_S",
           "DEFAULT_SAFETY_MARGIN", "DISPERSION_LIMIT", "DYNAMIC", "FIRST_STEP_FACTOR", "FIT_MARGIN",
           "FROM_CACHE_SHARE", "GROW_MIN_BUDGET", "INFEASIBLE_TIME", "IO_S_PER_GB", "KEEP_AT_FULL_BUDGET",
           "LEADERS_MAX", "LEADER_MEDIAN_SE", "LEADER_NOISE_FLOOR", "LEADER_NOISE_SIGMAS", "LEADER_RUNS",
           "LOW_BUDGET", "MAX_CANDIDATES", "MAX_CRASHES_IN_A_ROW", "MAX_KEPT_ERRORS", "MAX_PREDICTED_IN_A_ROW",
           "MICRO_STEP_PRIOR", "REASON_CHARS", "RECOMPUTE_PRIOR", "REGIONAL_COMPILE_SHARE", "RESERVE_MARGIN",
           "UNMEASURED_MARGIN", "WARM_PRUNE_MIN_STEPS", "BudgetCurve", "Candidate", "CompiledMemoryModel",
           "CompiledObservation", "CompiledTimeModel", "Decision", "MemoryModel", "MemoryObservation",
           "ModelAdvisor", "ModelErrors", "Proposal", "SavingModel", "SearchPolicy", "SearchSpace", "ShardingFacts",
           "SplitPlan", "StepTimeModel", "TimeBudget", "TrialFigures", "TrialHistory", "activation_budget",
           "balanced_split", "balanced_split_for", "budget_grid", "cache_dir", "cache_order",
           "choose_checkpointing", "compile_env", "compile_figures", "compile_notes", "compile_times",
           "compiled_candidates", "compiled_graphs", "compiled_observations", "dominating_over_cap",
           "figures_from_outcome", "fix_exchange_rate", "forecast_verification", "from_cache_s", "graph_keys",
           "graph_probe", "graphs_verdict", "model_errors_line", "next_trial_s", "observations_from_trials",
           "penalised", "per_trial_overhead_s", "plans_from_model", "predict_config_feasible", "predict_feasible",
           "proposable_dtypes", "proposal_line", "proposals_stalled", "rate_fixed", "rate_source", "restarts",
           "space_problem", "spread_fraction", "trial_s", "typical_compile_s", "verification_runs",
           "worker_start_s"]
