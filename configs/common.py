"""What the configs share: every section with its defaults, and the tiny shrink.

A config file starts from ``base()`` and changes what differs:

    from configs import common

    def get_config(arg=None):
      c = common.base()
      c.task.name = "arithmetic"
      ...
      return common.apply_arg(c, arg)

``python -m launch.*`` and the tests run from the repository root, so
``configs`` is importable there. Every field below is read by
``rljax/train/build.py``; ``--config.<section>.<field>=...`` overrides it.
"""

import ml_collections

placeholder = ml_collections.config_dict.placeholder


def base() -> ml_collections.ConfigDict:
  """Every section of a training config, with the library's defaults."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.task = ml_collections.ConfigDict()
  c.task.name = "arithmetic"
  c.task.kwargs = ml_collections.ConfigDict({})
  c.task.num_train = 6000
  c.task.path = ""               # a JSONL file instead of a built-in task
  c.task.heldout_path = ""       # empty: the head of task.path
  c.task.required_fields = ("prompt", "answer")  # every JSONL line must have them
  # No answers in the data, or fewer held-out examples than eval.num_examples:
  # "error" (default) or "warn".
  c.task.on_data_problem = "error"

  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.path = ""          # empty: train a small sentencepiece model
  c.tokenizer.vocab_size = 32
  c.tokenizer.corpus_size = 2000
  c.tokenizer.chat_template = False  # wrap prompts in a checkpoint's template

  c.model = ml_collections.ConfigDict()
  c.model.path = ""              # a Hugging Face checkpoint directory
  c.model.preset = "small"       # used when model.path is empty
  c.model.overrides = ml_collections.ConfigDict({})

  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})

  c.sampler = ml_collections.ConfigDict()
  c.sampler.max_new_tokens = 32
  c.sampler.temperature = 1.0
  c.sampler.top_k = placeholder(int)
  c.sampler.top_p = placeholder(float)
  c.sampler.min_p = placeholder(float)
  c.sampler.prompt_buckets = (16, 32)
  c.sampler.cache_dtype = "bfloat16"
  c.sampler.share_prefix = True
  # Decode-step count of the first length segment (each next one doubles;
  # a segment's cache holds only the slots its steps can fill).
  c.sampler.segment_slots = 64
  # SPEC-RL (rljax.sampling.speculative): a prompt's previous rollout is the
  # draft, verified in one pass; accept token w.p. min(1, e^lenience p/q).
  # Drafts live in a bounded per-prompt store, saved with each checkpoint.
  c.sampler.speculative = False
  c.sampler.spec_log_lenience = 0.5
  c.sampler.spec_store_prompts = 4096

  c.sft = ml_collections.ConfigDict()
  c.sft.num_steps = 0
  c.sft.batch_size = 64
  c.sft.learning_rate = 3e-3
  c.sft.num_examples = 4000
  c.sft.max_length = 16
  c.sft.label_noise = 0.0        # fraction of near-miss demonstrations

  c.rl = ml_collections.ConfigDict()
  c.rl.num_steps = 100
  c.rl.prompts_per_step = 32
  c.rl.group_size = 8
  c.rl.num_epochs = 1
  c.rl.num_minibatches = 1
  c.rl.num_microbatches = 1
  # A preset (grpo, dr_grpo, rloo, reinforce_pp, mc_grpo, gdpo, batch_std,
  # rank_weights, grpo_batch_std, gpg, pass_at_k, opo, reinforce_pp_token,
  # vcpo, ktae, remax) or transforms joined with "+", e.g.
  # "center_by_group_median+scale_by_group_mad" (rljax.train.algorithm).
  c.rl.advantage = "grpo"
  c.rl.advantage_clip = placeholder(float)
  c.rl.rank_weights = "median:3"  # with rank_weights: median:k, cvar:k:alpha, ...
  c.rl.pass_k = 2  # with pass_at_k: the k of pass@k (<= rl.group_size)
  c.rl.pass_threshold = 1.0  # with pass_at_k: a reward >= this is a pass
  # DAPO's overlong penalty (the overlong_penalty link): the ramp length
  # (None: sampler.max_new_tokens // 5, DAPO's 4096 of 20480) and its depth.
  c.rl.overlong_buffer = placeholder(int)
  c.rl.overlong_penalty_factor = 1.0
  # Peer conventions (docs/conventions.md): the epsilon added to every std
  # (None: the chain's own, 1e-6 as verl; TRL uses 1e-4); what a group with
  # one valid sample gets ("zero", as TRL; "raw": its reward, as verl); a
  # row whose every reward failed ("exclude": out of the statistics, as TRL;
  # "zero": scored 0, as TRL before PR #5902).
  c.rl.std_eps = placeholder(float)
  c.rl.singleton_groups = "zero"
  c.rl.failed_rewards = "exclude"
  # ppo_clip, dual_clip, gspo, cispo, ess (FeynRL), reinforce, sapo, gmpo,
  # pnpo, dppo_tv, dppo_kl (deltas: the clip_eps fields), clip_cov, kl_cov,
  # dcpo, bandpo_tv, bandpo_chi2, bandpo_kl, bapo, sat (rljax.objectives).
  c.rl.objective = "ppo_clip"
  c.rl.clip_eps_low = 0.2
  c.rl.clip_eps_high = 0.28
  c.rl.dual_clip_c = 3.0         # dual_clip: no gradient where A < 0, r > c
  c.rl.gspo_eps_low = 3e-4       # GSPO's clip range (paper values)
  c.rl.gspo_eps_high = 4e-4
  c.rl.gspo_max_log_ratio = placeholder(float)  # verl clamps log s at 10
  c.rl.cispo_cap = 5.0           # CISPO's absolute cap (TRL's epsilon_high)
  c.rl.sapo_tau_pos = 1.0        # SAPO's gate temperatures (verl, TRL)
  c.rl.sapo_tau_neg = 1.05
  c.rl.gmpo_eps = 0.4            # GMPO's clip range, in log space
  c.rl.clip_cov_ratio = 2e-4     # Clip-Cov: fraction of tokens dropped,
  c.rl.clip_cov_low = 1.0        # drawn among covariances in (low, high)
  c.rl.clip_cov_high = 5.0
  c.rl.kl_cov_ratio = 2e-4       # KL-Cov: fraction of tokens penalised
  c.rl.kl_cov_coef = 1.0         # and the penalty's weight
  c.rl.dcpo_clip_c = 10.0        # DCPO's dual clip and cap of its upper bound
  c.rl.band_delta = 0.05         # BandPO's divergence radius
  c.rl.bapo_target = 1.0         # BAPO: positive / negative contribution
  c.rl.sat_quantile = 0.9        # SAT: |log pi - log mu| quantile of the gate
  c.rl.is_correction = "none"    # none, tis, mis
  c.rl.is_cap = 2.0
  c.rl.is_floor = placeholder(float)  # tis: lower bound of the weight
  c.rl.is_batch_normalize = False     # tis: divide the weights by their mean
  c.rl.is_level = "token"        # token, sequence
  # verl's rollout rejection: tokens/sequences leave the loss mask (and its
  # normaliser), e.g. "seq_sum_k1:0.5:2.0" or "token_k3:0.1,seq_max_k2:0.5"
  # (objectives.parse_rejection); "" is off.
  c.rl.rejection = ""
  # token_mean, token_sum, sequence_mean_token_mean, sequence_mean_token_sum,
  # sequence_mean_token_sum_norm (Dr.GRPO), sequence_mean_token_scale (Tunix).
  c.rl.aggregation = "token_mean"
  c.rl.count_empty_sequences = False  # True: every row counts (TRL grpo)
  c.rl.max_log_ratio = 20.0      # clamp of the log-ratio (verl 20, TRL none)
  c.rl.kl_coef = 0.0
  # k3, k1, k2, abs, low_var_kl (verl), k1+, k3+ (straight-through), k3_is
  # (TRL's bias-corrected); objectives.KL_ESTIMATORS.
  c.rl.kl_estimator = "k3"
  c.rl.entropy_coef = 0.0
  c.rl.training_temperature = 1.0
  # pi_old: "recompute" (trainer forward) or "sampler" (its logprobs; bypass).
  c.rl.old_logprobs = "recompute"
  # FeynRL's token-level ESS: pooled per "microbatch" or "minibatch".
  c.rl.ess_pooling = "microbatch"
  c.rl.ess_kl_coef = placeholder(float)  # default: 1 with objective=ess, else 0
  # On-policy distillation: weight of the per-token reverse KL to the teacher
  # of teacher.path (rljax.train.distill); 0 (default) turns it off.
  c.rl.distill_coef = 0.0

  # PPO with a value model, read only with rl.advantage="gae"
  # (rljax.train.critic): GAE's discount and lambda, verl's value clip, and
  # the critic's own optimizer (Adam).
  c.critic = ml_collections.ConfigDict()
  c.critic.gamma = 1.0
  c.critic.lam = 1.0
  c.critic.value_clip = 0.5     # None: no value clipping
  c.critic.whiten = True        # whiten the advantages over the batch (verl)
  c.critic.learning_rate = 1e-5
  c.critic.max_grad_norm = 1.0

  # The teacher of on-policy distillation (with rl.distill_coef > 0): an
  # rljax run directory (checkpoint teacher.step, latest if None) or a
  # Hugging Face checkpoint directory sharing the student's tokenizer.
  c.teacher = ml_collections.ConfigDict()
  c.teacher.path = ""
  c.teacher.step = placeholder(int)
  c.teacher.temperature = 1.0

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 1e-6
  c.optimizer.warmup_steps = 0
  c.optimizer.schedule = "constant"
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = 1.0
  # VCPO: None, "sqrt" or "linear" scaling by the sequence-level ESS.
  c.optimizer.ess_scaling = placeholder(str)
  c.optimizer.max_consecutive_nonfinite = 5

  c.rewards = ml_collections.ConfigDict()
  c.rewards.names = ("numeric_match",)
  c.rewards.weights = (1.0,)
  c.rewards.num_workers = 2
  c.rewards.timeout_s = 10.0
  # Finite rewards beyond +-clip are clipped (and counted); None: such
  # values beyond float32 are counted invalid.
  c.rewards.clip = placeholder(float)
  c.rewards.memory_limit_mb = placeholder(int)  # per reward worker, over its start-up size
  # Stop when more than this fraction of (sample, reward) pairs get no reward
  # for failure_patience RL steps in a row.
  c.rewards.max_failure_fraction = 0.99
  c.rewards.failure_patience = 5

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 50
  c.eval.num_examples = 256
  c.eval.num_samples = 1
  c.eval.greedy = True
  c.eval.reward = ""             # the reward that counts as correct (default: first)

  c.checkpoint = ml_collections.ConfigDict(
      {"every": 50, "max_to_keep": 2, "best_metric": "", "best_mode": "max"})
  return c


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks a config to CPU-test size: tiny model, arithmetic, 3 RL steps."""
  c.task.name = "arithmetic"
  c.task.path = c.task.heldout_path = ""
  c.task.kwargs = ml_collections.ConfigDict({"min_digits": 1, "max_digits": 2})
  c.task.num_train = 200
  c.tokenizer.chat_template = False
  c.model.path = ""
  c.model.preset = "tiny"
  c.model.overrides = ml_collections.ConfigDict({})
  c.sampler.max_new_tokens = 6
  c.sampler.prompt_buckets = (8, 16)
  c.sampler.cache_dtype = "float32"
  c.sft.num_steps = 4
  c.sft.num_examples = 64
  c.sft.batch_size = 8
  c.rl.num_steps = 3
  c.rl.prompts_per_step = 8
  c.rl.group_size = 4
  c.eval.num_examples = 16
  c.eval.every = 2
  c.checkpoint.every = 2
  c.rewards.num_workers = 0
  return c


def apply_arg(c: ml_collections.ConfigDict, arg: str | None
              ) -> ml_collections.ConfigDict:
  """The config argument: '' (as is) or 'tiny' (``tiny(c)``)."""
  if arg == "tiny":
    return tiny(c)
  if arg:
    raise ValueError(f"config argument {arg!r}: accepted '' or 'tiny'.")
  return c
