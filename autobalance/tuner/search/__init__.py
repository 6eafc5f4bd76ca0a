"""The search: what the study looks for and how it looks.

- ``_space``: the search space (micro-batch shares, accumulation, checkpointing, dtype, buckets, compile);
- ``_objective``: from a trial's rank reports to its figures, objective values and memory constraint;
- ``_memory_model``: per-rank peak memory, fitted from the study's trials;
- ``_step_time``: step time, fitted from the study's trials;
- ``_solver``: balanced splits and per-rank checkpointing from the memory model;
- ``_eager_search``: the memory model's eager proposals;
- ``_holdout``: what the memory models are fitted from, and their leave-one-trial-out errors;
- ``_compiled_model``: compiled configurations' peaks (per-rank budgets) and step times;
- ``_compiled_search``: compiled proposals from it, ordered to reuse the Inductor cache;
- ``_dominance``: model-free "cannot fit" from launched trials that did not fit;
- ``_compile``: compile in the study (cache, space check, compile figures);
- ``_first_trials``: on a GPU, which dtypes the models may propose (bf16 first) and when the sampler explores;
- ``_model_errors``: the errors a fit can raise, and the ones the search fell back from (kept in the study);
- ``_advisor``: the ``model`` strategy: proposals and predicted OOMs, built on all of the above.

Nothing here launches a trial; the study's running side (``autobalance.tuner``) uses these.
"""

from __future__ import annotations

from autobalance.tuner.search._advisor import (
    ModelAdvisor,
    observations_from_trials,
)
from autobalance.tuner.search._compile import (
    CACHE_HIT_PRIOR_S,
    COMPILE_PRIOR_S,
    cache_dir,
    compile_env,
    compile_figures,
    compile_notes,
    compile_times,
    space_problem,
)
from autobalance.tuner.search._compiled_model import (
    COMPILE_SPEED_PRIOR,
    MICRO_STEP_PRIOR,
    RECOMPUTE_PRIOR_COMPILED,
    UNMEASURED_MARGIN,
    BudgetCurve,
    CompiledMemoryModel,
    CompiledObservation,
    CompiledTimeModel,
    budget_grid,
    compiled_observations,
)
from autobalance.tuner.search._compiled_search import (
    CACHE_TIE,
    DYNAMIC,
    Candidate,
    cache_order,
    compiled_candidates,
    compiled_graphs,
    graph_keys,
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
    figures_from_outcome,
    penalised,
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
)
from autobalance.tuner.search._step_time import (
    RECOMPUTE_PRIOR,
    StepTimeModel,
)

__all__ = [
    "ACTIVATION_BYTES_SCALE",
    "BUDGET_RANGE",
    "CACHE_HIT_PRIOR_S",
    "CACHE_TIE",
    "COMPILE_PRIOR_S",
    "COMPILE_SPEED_PRIOR",
    "DEFAULT_RECOMPUTE_FRACTION",
    "DEFAULT_SAFETY_MARGIN",
    "DYNAMIC",
    "FIT_ERRORS",
    "GRAPH_GAIN",
    "INFEASIBLE_TIME",
    "LOW_BUDGET",
    "MICRO_STEP_PRIOR",
    "PRIOR_CHECKPOINT_SAVING",
    "RECOMPUTE_PRIOR",
    "RECOMPUTE_PRIOR_COMPILED",
    "SHARE_RANGE",
    "UNMEASURED_MARGIN",
    "BudgetCurve",
    "Candidate",
    "CompiledMemoryModel",
    "CompiledObservation",
    "CompiledTimeModel",
    "DtypeFit",
    "MemoryModel",
    "MemoryObservation",
    "ModelAdvisor",
    "ModelErrors",
    "Proposal",
    "SavingModel",
    "SearchPolicy",
    "SearchSpace",
    "ShardingFacts",
    "SplitPlan",
    "StepTimeModel",
    "TrialFigures",
    "TrialHistory",
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
    "graph_keys",
    "graph_probe",
    "graphs_verdict",
    "model_errors_line",
    "observations_from_trials",
    "penalised",
    "plans_from_model",
    "predict_config_feasible",
    "predict_feasible",
    "proposable_dtypes",
    "proposal_line",
    "proposals_stalled",
    "space_problem",
    "spread_fraction",
]
