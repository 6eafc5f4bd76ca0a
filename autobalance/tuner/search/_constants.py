"""Every constant the search and the time budget decide by, each with the measurement it comes from: one number per
rule. ``tests/test_constants.py`` fails on a numeric module constant elsewhere in ``autobalance/tuner`` (unit
conversions and the ``--memory-cap`` GPU table of ``_settings`` aside)."""

from __future__ import annotations

# ---------------------------------------------------------------------- the policy's phases (``_policy``)
KEEP_AT_FULL_BUDGET = {True: 0.75, False: 1.0}
"""Prior: the fraction of the eager per-sample activations a compiled graph keeps at budget 1.0, by
whether the loss is inside the compiled model (``plan.wrap(loss=...)``). Measured on one H200
(``benchmarks/2026-12-04-h200``, the GPT of ``studies/gpt-1gpu.toml``, 9.58 GiB held, 0.97 GiB per
sample eager): loss inside 0.63-0.73 (whole 8 x 4, regional 8 x 4 and 16 x 2); loss outside 0.97-1.01
(its full-precision logits stay outside the graph); used until the compiled model is fitted."""
FIT_MARGIN = 0.03
"""The first compiled trial's predicted peak stays this fraction below the usable memory."""
GROW_MIN_BUDGET = 0.5
"""``compiled-grow`` takes one micro-step fewer only while the budget predicted to fit stays at or above this: on
one H200 (``benchmarks/2026-12-04-h200``) a micro-step costs ~30 ms of launches whatever its size, so a larger
micro-batch at budget 0.5 or more beat the smaller one at 1.0 (regional 16 x 2 at 0.5: 128.9 ms, 8 x 4 at 1.0:
140.3 ms), at 0.3 no longer (139.0 ms). Below it, ``grow-probe`` measures the split rather than trust an
extrapolated time (recomputation's cost per unit of budget ranged 0.1-0.7 of a step: regional 16 x 2 inside 122.6
ms at 1.0, 139.0 at 0.3; regional 8 x 4 outside 138.3 at 1.0, 185.8 at 0.5)."""
SCOPE_TRANSFERS = 2
"""``scope-probe`` runs the fastest this many measured compiled splits in the other scope (the scopes'
optima differ: on the H200, regional 11,11,10 was its best split and whole 8 x 4 the grid's)."""
SAME_WITHIN = 0.03
"""Two measured step times this close (relative to the faster) are one within the noise: on one H200
single steps of one configuration ranged about +-15 % (143-194 ms, regional 8 x 4), so two
configurations 3 % apart are not separated by a median of 8-12 steps. A compiled split of two
micro-step sizes (compiled with a dynamic batch dimension: 5,5,5,5,4,4,4 ran 255-275 ms where 8 x 4
ran 159 ms) is proposed again only when one measured within this of the best."""
RAISE_CHANGE_MARGIN = 1.0
"""``raise-budget`` keeps a trial's measured peak plus the compiled model's predicted change counted ``1 + this``
times within the usable memory (the measured part is known; the prediction is what errs): on the H200, regional
8 x 4 with the loss outside peaked 14.23 GiB at 0.5, 15.21 at 0.7 and 15.21 at 0.85, so a line through two budgets
errs by up to the whole change. A margin of the usable memory instead never raised a peak already within 3 % of it
(the replay's second machine, 8 x 4 at 0.65: 27.7 of 28.5 GiB, 17 % faster at 0.85 and 27.96); its peaks at 0.7 and
0.85 are equal (the H200's too, 28.40 GiB), so a trial over the usable memory caps the split's budget."""
TRANSFER_WITHIN = 1.15
"""``scope-probe`` runs a measured split in the other scope only while it is within this of the fastest
(the single-step noise of :data:`SAME_WITHIN`): a slow split's compile in the other scope (regional
4 x 8 at 1.0, 339 ms against 8 x 4's 182 in the replay) does not pay for itself."""
BUDGET_CEILING = 1.0
"""``raise-budget`` proposes budgets up to this (the partitioner's default: it keeps what eager
keeps), in steps of :data:`BUDGET_STEP`. No phase lowers a budget: at one rank a lower budget at the
same split only recomputes more (in the replay such trials won only when noise favoured them)."""
LOW_BUDGET = 0.3
"""Budgets below this are proposed only where a higher one was measured at the same micro-batch and
scope: memory is not monotone in low budgets (pytorch/pytorch#197838; on the H200 whole-model 8 x 4
with the loss outside peaked at 15.5 GiB at budget 0.75 and 16.9 GiB at 0.5)."""

# ---------------------------------------------------------------------- pacing and vetoes (``_policy``' advisor)
MAX_PREDICTED_IN_A_ROW = 25
"""After this many trials in a row settled as ``predicted_oom`` without launching, the next is
launched whatever the models say (a model wrong in the safe direction cannot stall the study)."""
SAMPLER_EVERY = 3
"""``explore``: the sampler's trial every this-many-th ask (on a GPU only once the models' proposals
stopped improving: :data:`STALL_AFTER`)."""
WORTH = 1.5
"""The ``model`` phase proposes its best untried candidate only while its predicted objective is within this factor
of the best candidate's (tried or not): further down the ranking the models promise nothing a trial would teach."""
EAGER_FIRST = 3
"""With compile searched, a dtype's compiled proposals wait until this many eager trials of it were
measured (or its eager memory model is fully determined): eager trials take seconds and give the
compiled model its fixed part and activation unit; a compile takes tens of seconds."""

# ---------------------------------------------------------------------- proposals (``_models``' candidates)
CACHE_TIE = 0.02
"""Relative difference of predicted objective (or of a rank's predicted time) treated as a tie,
which the configuration needing fewer new compiled graphs wins."""
SLOW_DTYPE = 1.5
"""A dtype whose measured eager cost per sample is this many times the fastest one's is not compiled."""
NEIGHBOUR_RANKS = 4
"""Up to this many ranks, one-sample neighbours of each split are tried too."""
STALL_AFTER = 2
"""The models' proposals have stopped improving when this many launched ones in a row did not
improve the study's best objective (by :data:`IMPROVES`)."""
IMPROVES = 0.01
"""A relative drop of the best objective smaller than this is noise, not an improvement."""
GRAPH_GAIN = 0.03
"""A graph trial pays when its step is at least this fraction faster than its default-mode twin's
(the same configuration in mode ``default``): more than the step-time noise of a compiled trial."""
SHARE_TOL = 1e-9
"""Cumulative shares this close are the same boundary (sums of 4-decimal shares in floating point)."""

# ---------------------------------------------------------------------- step-time priors (``_timing``, ``_solver``)
RECOMPUTE_PRIOR = 1.0
"""While checkpointing has not varied: recomputing all blocks once costs one typical micro-step
(``b + k * m``; the H200 grid of the GPT scenario measured 0.85 of it)."""
EQUAL_SPEED_BAND = 1.15
"""Ranks whose measured per-sample costs differ by less than this factor count as equally fast (the
model then has no per-rank speeds, so equal devices keep the plans of a model without them: busy
times of equal ranks differ by a few percent of noise)."""
DTYPE_SPEED_PRIOR = {"cuda": {"bf16": 0.55, "fp16": 0.55, "fp32": 1.0}, "cpu": {"bf16": 1.2, "fp16": 1.5, "fp32": 1.0}}
"""Step time per dtype relative to fp32 before the study measured that dtype (replaced by measurements)."""
SHARDING_TIME_PRIOR = {"embeddings": 1.43, "blocks": 2.13}
"""Step time of a ``param_sharding`` relative to the same configuration unsharded, before the study
measured a trial of that sharding (then the measured ratio replaces it). One H200, ``studies/gpt-1gpu.toml``'s
~270M GPT at world size 1 (FSDP2's own machinery, no communication), bf16, 8 x 4 eager: 175.1 ms plain,
250.7 ms ``embeddings``, 373.6 ms ``blocks`` (``benchmarks/2026-12-05-h200/fsdp_overhead.json``). More ranks
add communication, so this is the least a sharding costs there; no CPU figure of a realistic model exists,
so the CPU path starts from the same ratios."""
DEFAULT_RECOMPUTE_FRACTION = 1.0 / 3.0
"""Extra compute of a checkpointed block relative to its forward+backward (one more forward): the
solver's ranking of checkpointing plans before the step-time model measured recomputation."""

# ---------------------------------------------------------------------- compile priors (``_compile``)
CACHE_HIT_PRIOR_S = 2.0
"""A compile served by the Inductor cache in a warm worker, at least (one H200: FX-graph-cache hits
1.3-1.9 s, field notes)."""
COMPILE_PRIOR_S = {"cuda": 45.0, "cpu": 20.0}
"""A compile with cache misses, before the study measured one (one H200: 15-94 s per configuration;
2 CPU cores: 18-25 s)."""
REGIONAL_COMPILE_SHARE = (0.22, 0.30)
"""A regional compile's time as a share of the whole-model compile of the same configuration (low,
high): one H200, the ~270M GPT, the product's runtime, 0.22-0.30 at equal points
(``benchmarks/2026-12-04-h200``). A scope the study has not compiled is priced from the other one
at the end of the range that makes it dearer (whole = regional / 0.22, regional = whole x 0.30)."""
FROM_CACHE_SHARE = 0.4
"""A compile from the study's Inductor cache in a new process, as a share of what the same graphs took cold, where
the study measured no cache hit (``compile_times``'s prior and verification's forecast). One H200: ``h200c`` trial
4 compiled cold in 36.9 s; its verification's ``tuned`` run, from the study's cache, took 21.5 s with its read:
less 1.0 s start-up and hand-over, 5.4 s of tensors and 0.45 s of steps, 14.7 s (0.40);
``benchmarks/2026-12-03-h200b/compile_probe.json``: 8 x 4 default 28.2 s cold, 5.2 s in a second process on the
same cache (0.18); whole-model compiles from a shared cache took 29-34 s of process wall against 46-52 s cold,
start-up included (field notes 2026-12-04). The largest measured share, so a budget is not overdrawn."""

# ---------------------------------------------------------------------- verification's price (``_timing``)
FLOOR_RUNS = 1
"""Shared fp32 runs of the script's own configuration besides ``baseline`` and ``baseline-fp32``:
the rounding floor (the same step with each micro-batch's samples reversed)."""
IO_S_PER_GB = 5.0
"""A verification run's tensor input and output per GB of parameters: one H200 machine, the ~270M GPT
(1.08 GB in fp32): starting weights 0.8-1.7 s, saving the step 2.1-3.4 s, reading it 1.3-2.6 s, 4.6-6.6 s
a run (``benchmarks/2026-12-03-h200b`` and ``-h200c``, ``tune_gpt-1gpu.log``)."""
COMPARE_S_PER_GB = 3.0
"""One comparison of two runs' tensors (gradients, parameters, update, buffers) per GB of parameters:
the ~270M GPT's verifications spent 13.5 s (``h200b`` trial 5, 4 comparisons) and 12.3 s (``h200c``
trial 4, 4) outside their runs: 3.1-3.4 s a comparison of 1.08 GB."""
FIRST_STEP_FACTOR = 2.0
"""A verification run's one step costs this many measured steps (no warm-up step before it)."""
RESERVE_MARGIN = 1.2
"""The reserve is the forecast times this: runs of one kind spread by ~20 % within one verification (eager one-step
runs 5.0-6.8 s in ``h200c``'s), and the from-cache compile is priced from one measured share."""
MAX_CANDIDATES = 3
"""When the best configuration fails verification, the next best are tried (distinct configurations)."""

# ---------------------------------------------------------------------- the loop and its launches (``tuner/``)
MAX_CRASHES_IN_A_ROW = 3
"""The study stops after this many trials in a row crashed (a crash is not the configuration's fault:
the same crash again is the machine's or the script's)."""
DISPERSION_LIMIT = 0.05
"""Re-measure when a rank's measured steps' IQR exceeds this fraction of their median."""
AUTO_MEASURE_FACTOR = 7 / 3
"""``--measure-s auto``: measure 7/3 of the overhead, so the overhead is <= 30 % of a trial."""
AUTO_MEASURE_MAX_S = 2.0
"""``--measure-s auto`` never measures longer than this (cold trials' overhead is seconds)."""
WARM_PRUNE_MIN_STEPS = 20
"""A warm trial (one launch, no torchrun start-up to amortise) is pruned early only when it runs at
least this many steps; cold and multi-node trials always may be."""
MAX_KEPT_ERRORS = 20
"""The study keeps the last this many caught fit errors."""
MAX_ERROR_TEXT = 200
"""A kept fit error's text is cut to this many characters."""

# ---------------------------------------------------------------------- parameter sharding (``search/_sharding``)
EMBEDDING_SHARE = 0.1
"""The dimension is searched (more than one rank) when the embedding-like modules the baseline's model
holds (``model.embedding_bytes``), with their gradients and AdamW's two moments (4x their bytes), are
at least this share of a rank's usable memory: what every DDP rank replicates of them is then worth
sharding (Llama-3's 128k x 4096 embedding and head: 16.8 GB of an 80 GB card)."""
FIXED_SHARE = 0.5
"""A sharding is proposed when nothing unsharded fits and a rank's fixed part (parameters, gradients
and optimizer state, unsharded) is at least this share of its usable memory."""
FIT_FRACTION = 0.85
"""The least sharding proposed is the first whose predicted fixed part is below this share of the
tightest rank's usable memory (the rest is left to activations); else the most."""

# ---------------------------------------------------------------------- the leaders re-measured before saving (``tuner/_remeasure``)
LEADER_NOISE_FLOOR = 0.05
"""Two measured configurations whose step times differ by less than this fraction of the faster one are not told
apart by one measurement each, whatever their own steps' spread says: single steps spread +-15 %
(:data:`SAME_WITHIN`, a standard deviation near 15 / sqrt(3) ~ 8.7 %), so a median of 9 varies by about
1.25 x 8.7 / sqrt(9) ~ 3.6 % and a difference of two by sqrt(2) x 3.6 ~ 5 %. Across a warm study one configuration
measured 177-239 ms: the run-to-run drift is no smaller."""
LEADER_MEDIAN_SE = 0.93
"""A median's standard error over ``n`` steps is about this times the steps' IQR / sqrt(n) (a normal
sample: the median's standard error is 1.2533 sigma / sqrt(n), and the IQR is 1.349 sigma); at least
:data:`LEADER_NOISE_FLOOR`."""
LEADER_NOISE_SIGMAS = 2.0
"""A leader is within the measured noise of the best when their step times differ by less than this
many standard errors of the difference (:data:`LEADER_MEDIAN_SE`): at 2, a difference the noise
alone would produce 95 % of the time."""
LEADERS_MAX = 3
"""At most this many leaders (the best and those within its noise) are re-measured before saving:
each costs its runs' time (per run a trial's start-up, its compile from the study's cache and its
steps), so 3 leaders at 2 runs is already 6 runs; 2 is the least that decides anything."""
LEADER_RUNS = (3, 2, 1)
"""More runs of each leader, interleaved (A, B, A, B, ...), the most first, each leader's steps
pooled with its own: with 3 more runs no single run's drift (:data:`LEADER_NOISE_FLOOR`) decides; 1
is the least that measures the leaders again side by side in the same worker state."""

# ---------------------------------------------------------------------- compiled step-time priors (``_timing.CompiledTimeModel``)
MICRO_STEP_PRIOR: dict[str, float] = {"reduce-overhead": 0.18}
"""Prior ``beta`` per compile mode (others 1.0): on one H200 the GPT of ``studies/gpt-1gpu.toml`` paid
33 ms per micro-step compiled with ``default`` and 5.8 ms with ``reduce-overhead`` (CUDA graphs):
5.8 / 33 = 0.18 (``benchmarks/2026-12-03-h200b/compile_probe*.json``, ``docs/compile.md``)."""
RECOMPUTE_PRIOR_COMPILED = 1.0 / 3.0
"""Prior ``rho``: at budget 0 the partitioner recomputes about one forward (a third of a step)."""
COMPILE_SPEED_PRIOR: dict[str, float] = {"cuda": 0.85, "cpu": 1.0}
"""Prior ``s`` (compiled / eager time) before any compiled trial: Inductor fuses on GPUs; on CPU
no gain is assumed."""
RHO_GRID = [i / 20 for i in range(41)]
"""The compiled step-time fit's grid of ``rho`` (recomputation at budget 0): 0 .. 2 in steps of 0.05,
wide enough for a partitioner that recomputes up to two forwards."""
BETA_GRID = [i / 20 for i in range(41)]
"""The compiled step-time fit's grid of ``beta`` (a compiled micro-step's fixed cost relative to the
eager one): 0 .. 2 in steps of 0.05 (the H200's CUDA graphs measured 0.18)."""

# ---------------------------------------------------------------------- the memory model (``_memory_model``)
ACTIVATION_BYTES_SCALE: dict[str, float] = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5}
"""Prior: per-sample activation bytes of each dtype relative to fp32 (autocast halves them; it keeps the fp32
parameters, gradients and optimizer state: a dtype borrowing another's fit keeps its fixed part)."""
PRIOR_CHECKPOINT_SAVING = 0.7
"""Prior: the share of the per-sample activations saved with every block checkpointed, while no
measured dtype has seen checkpointing vary (embeddings, logits and block inputs stay: below 1)."""
DEFAULT_SAFETY_MARGIN = 0.05
"""Initial relative margin: a prediction is trusted as feasible if ``peak * (1 + margin) <= limit``."""
MAX_MARGIN = 0.5
"""The margin never widens beyond this."""
WIDEN_FACTOR = 1.5
"""The margin's growth on an under-prediction beyond it (``_memory_model.widen_margin``, both memory models)."""
CLAMP_TOLERANCE = 0.01
"""A fitted line this far (relative) under the floor is still taken as possible: the floor is the least
held part ever measured on the rank, and a fit through those same points may pass just under it."""
RANK_TOL = 1e-10
"""Relative singular-value tolerance deciding which parameter directions the data determines."""
CONFIDENT_TOL = 1e-8
"""A query is confident when its (scaled) feature vector is this orthogonal to the unseen directions."""

# ---------------------------------------------------------------------- the compiled memory model (``_compiled_model``)
UNMEASURED_MARGIN = 0.25
"""Extra relative margin on the activation part at a budget the pair has not measured (divided by
``sqrt(1 + measured budgets)``): the partitioner's plateaus make interpolation uncertain."""
FLOOR_PRIOR = 0.25
"""Without any compiled trial, ``f(b) = max(b, FLOOR_PRIOR)``: at its smallest budget the partitioner
still keeps part of the activations (on one H200 the GPT of ``studies/gpt-1gpu.toml`` kept 0.42 of
its eager activations at budget 0.4 with the loss outside the model, about 0.38 with it inside)."""
LOW_BUDGET_FLOOR = 0.5
"""Below the smallest measured budget ``b_1``, ``f(b) = F_1 * max(b / b_1, LOW_BUDGET_FLOOR)``: not the
partitioner's proportional rule all the way down (the same grid: ``f(0.4) / f(1.0) = 0.68``)."""
MIN_SAMPLE_BYTES = 1.0
"""The least activation bytes of one sample (1 byte): keeps the compiled model's fractions finite when
the eager model predicts no activations for a rank."""

# ---------------------------------------------------------------------- the objective (``_objective``)
INFEASIBLE_TIME = 10.0
"""Normalised step time recorded for trials without a measurement (OOM, timeout)."""

# ---------------------------------------------------------------------- the search space's ranges and grid (``_space``)
SHARE_RANGE = (0.05, 1.0)
"""The range a rank's micro-batch share weight is sampled in (``share_r``): never 0, so every rank
keeps a sample (the shares are normalised over their sum)."""
BUCKET_RANGE_MB = (1.0, 200.0)
"""DDP's ``bucket_cap_mb`` range the space searches (log scale): 1 MB (many small all-reduces)
to 200 MB (one large one for the models studied; DDP's default is 25 MB)."""
BUDGET_RANGE = (0.05, 1.0)
"""The per-rank activation-memory budget range of compiled trials (``budget_r``): 0.05 (the
partitioner keeps the least it can) to 1.0 (its default)."""
BUDGET_STEP = 0.05
"""The budget grid's step: repeated budgets hit the per-study Inductor cache (a 0.05 grid gives 20
budgets; the H200 grids measured the curve's plateaus at this resolution). ``raise-budget`` steps by it too."""
OPTIMIZER_SHARE_RANGE = (0.0, 1.0)
"""A rank's ``oshare_r`` weight; the shares are the weights over their sum (all 0: even)."""

# ---------------------------------------------------------------------- markers and presentation (``_sharding``, ``_timing``, ``tuner/_reporter``)
LEVELS = {"off": 0, "embeddings": 1, "blocks": 2}
"""The parameter shardings' order (more sharding, higher): what dominance compares."""
DYNAMIC = 0
"""The micro-batch size of a graph compiled with a dynamic batch dimension."""
REASON_CHARS = 160
"""A trial's reason on its console line is cut near this many characters (at a word boundary)."""
