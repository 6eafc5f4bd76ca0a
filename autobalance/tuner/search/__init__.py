"""The search: what the study looks for and how, one concern per module (``docs/architecture.md``
names each). Nothing here launches a trial: ``autobalance.tuner`` does."""

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
    DISPERSION_LIMIT,
    FROM_CACHE_SHARE,
    LEADER_MEDIAN_SE,
    LEADER_NOISE_FLOOR,
    LEADER_NOISE_SIGMAS,
    LEADER_RUNS,
    LEADERS_MAX,
    MAX_CANDIDATES,
    MAX_CRASHES_IN_A_ROW,
    REASON_CHARS,
    WARM_PRUNE_MIN_STEPS,
)
from autobalance.tuner.search._dominance import dominating_over_cap
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
)
from autobalance.tuner.search._policy import ModelAdvisor, TrialHistory, proposal_line
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
    CompiledTimeModel,
    StepTimeModel,
    TimeBudget,
    cache_dir,
    compile_env,
    compile_notes,
    compile_times,
    compiled_graphs,
    from_cache_s,
    graph_keys,
    per_trial_overhead_s,
    trial_s,
    typical_compile_s,
)

__all__ = ["AUTO_MEASURE_FACTOR", "AUTO_MEASURE_MAX_S", "CACHE_HIT_PRIOR_S", "COMPILE_PRIOR_S",
           "DEFAULT_SAFETY_MARGIN", "DISPERSION_LIMIT", "DYNAMIC", "FROM_CACHE_SHARE", "INFEASIBLE_TIME",
           "LEADERS_MAX", "LEADER_MEDIAN_SE", "LEADER_NOISE_FLOOR", "LEADER_NOISE_SIGMAS", "LEADER_RUNS",
           "MAX_CANDIDATES", "MAX_CRASHES_IN_A_ROW", "MICRO_STEP_PRIOR", "REASON_CHARS", "UNMEASURED_MARGIN",
           "WARM_PRUNE_MIN_STEPS", "BudgetCurve", "Candidate", "CompiledMemoryModel", "CompiledObservation",
           "CompiledTimeModel", "Decision", "MemoryModel", "MemoryObservation", "ModelAdvisor", "ModelErrors",
           "SavingModel", "SearchSpace", "ShardingFacts", "SplitPlan", "StepTimeModel", "TimeBudget",
           "TrialFigures", "TrialHistory", "balanced_split", "balanced_split_for", "budget_grid", "cache_dir",
           "cache_order", "choose_checkpointing", "compile_env", "compile_figures", "compile_notes",
           "compile_times", "compiled_graphs", "compiled_observations", "dominating_over_cap",
           "figures_from_outcome", "fix_exchange_rate", "from_cache_s", "graph_keys", "graph_probe",
           "graphs_verdict", "model_errors_line", "observations_from_trials", "penalised", "per_trial_overhead_s",
           "plans_from_model", "predict_config_feasible", "predict_feasible", "proposable_dtypes", "proposal_line",
           "proposals_stalled", "rate_fixed", "rate_source", "space_problem", "trial_s", "typical_compile_s"]
