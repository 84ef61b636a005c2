"""Every config field: its default, its range and what it means, in one place.

``FIELDS`` maps ``"section.field"`` to a ``Field``. ``configs/common.py``
builds its ``base()`` from it (``base_config``), ``build.validate`` checks
every value against its rule, and ``complete`` fills what a partial config
(an older run's ``config.json``, a plain dict handed to
``algorithm.from_config``) leaves out. Nothing else in ``rljax/train``
restates a default. The fields of an algorithm name (``rl.pass_k`` of
``pass_at_k``, ``rl.cispo_cap`` of ``cispo``, ...) are declared by its entry
in ``rljax/train/table.py`` and merged in here.

A rule is one of ``_checks.check_range``'s (``"int>=1"``, ``">0"``,
``"(0,1]"``, ..., a trailing ``"?"`` also accepting None), or None for a
field that is checked by its own code (names, strings, tuples).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import ml_collections

from rljax.train import table
from rljax.train._field import Field


F = Field

_BASE: dict[str, Field] = {
    "seed": F(0, "int>=0", "the run's seed: params, data order, sampling"),
    # --- task ---
    "task.name": F("arithmetic", None, "a built-in task (rljax.data.TASKS)"),
    "task.kwargs": F({}, None, "keyword arguments of the built-in task"),
    "task.num_train": F(6000, "int>=1", "training examples of a built-in task"),
    "task.path": F("", None, "a JSONL file instead of a built-in task"),
    "task.heldout_path": F("", None, "held-out JSONL (empty: the head of task.path)"),
    "task.required_fields": F(("prompt", "answer"), None,
                              "fields every JSONL line must have"),
    "task.on_data_problem": F("error", None,
                              "no answers or too few held-out examples",
                              choices=("error", "warn")),
    # --- tokenizer ---
    "tokenizer.path": F("", None, "empty: train a small sentencepiece model"),
    "tokenizer.vocab_size": F(32, "int>=1", "vocabulary of a trained tokenizer"),
    "tokenizer.corpus_size": F(2000, "int>=1", "examples it is trained on"),
    "tokenizer.chat_template": F(False, None,
                                 "wrap prompts in the checkpoint's template"),
    # --- model ---
    "model.path": F("", None, "a Hugging Face checkpoint directory"),
    "model.preset": F("small", None, "used when model.path is empty"),
    "model.overrides": F({}, None, "ModelConfig fields to override"),
    "model.lora.rank": F(0, "int>=0", "LoRA adapters' rank r (0: train "
                         "every param)"),
    "model.lora.alpha": F(16.0, ">0", "the adapters' output is scaled by "
                          "alpha / rank"),
    "model.lora.targets": F(("q", "k", "v", "o", "gate", "up", "down"), None,
                            "projections with adapters"),
    "model.lora.quantize_base": F("none", None, "the frozen base's "
                                  "projection kernels", choices=("none",
                                                                 "int8")),
    # --- mesh ---
    "mesh.data": F(1, None, "data-parallel axis (-1: the rest)"),
    "mesh.fsdp": F(-1, None, "parameter-sharded data axis (-1: the rest)"),
    "mesh.tensor": F(1, None, "tensor-parallel axis"),
    # --- sampler ---
    "sampler.max_new_tokens": F(32, "int>=1", "the generation budget T"),
    "sampler.temperature": F(1.0, ">0", "sampling temperature"),
    "sampler.top_k": F(None, "int>=1?", "keep the k most likely tokens", int),
    "sampler.top_p": F(None, "(0,1]?", "nucleus sampling", float),
    "sampler.min_p": F(None, "[0,1)?", "min-p sampling", float),
    "sampler.prompt_buckets": F((16, 32), None, "padded prompt lengths"),
    "sampler.cache_dtype": F("bfloat16", None, "KV cache dtype"),
    "sampler.share_prefix": F(True, None, "prefill a group's prompt once"),
    "sampler.segment_slots": F(64, "int>=1", "decode steps of the first "
                               "length segment (each next one doubles)"),
    "sampler.shrink_batch_to": F(None, "int>=1?", "as rows end, decode the "
                                 "live ones in halved batches down to this "
                                 "many rows (None: every row to the end)",
                                 int),
    "sampler.kv_cache": F("dense", None, "the static batch's KV cache: "
                          "rows of their own, or blocks shared by a group "
                          "and freed as rows end (docs/rollouts.md)",
                          choices=("dense", "paged")),
    "sampler.kv_block_size": F(16, "int>=1", "paged: slots per block"),
    "sampler.kv_blocks": F(None, "int>=1?", "paged: blocks in the pool "
                           "(None: the worst case; fewer: a row that finds "
                           "none ends, counted in rollout/kv_cut_rows)", int),
    "sampler.speculative": F(False, None, "SPEC-RL: a prompt's previous "
                             "rollout is the draft, verified in one pass"),
    "sampler.spec_log_lenience": F(0.5, ">=0", "SPEC-RL: accept a draft "
                                   "token w.p. min(1, e^lenience p/q)"),
    "sampler.spec_store_prompts": F(4096, "int>=1", "SPEC-RL: prompts whose "
                                    "drafts are kept (saved with checkpoints)"),
    # --- sft ---
    "sft.num_steps": F(0, "int>=0", "warm-up steps (0: none)"),
    "sft.batch_size": F(64, "int>=1", "rows per warm-up step"),
    "sft.learning_rate": F(3e-3, ">0", "warm-up peak learning rate"),
    "sft.num_examples": F(4000, "int>=1", "demonstrations drawn from the task"),
    "sft.max_length": F(16, "int>=1", "padded warm-up row length"),
    "sft.label_noise": F(0.0, "[0,1)", "fraction of near-miss demonstrations"),
    "sft.padding_free": F(True, None, "warm-up rows packed, real tokens only "
                          "(the same loss; False: padded rows)"),
    "sft.cache_dir": F("", None, "finished warm-ups kept and reused "
                       "(train/sft_cache.py; '': $RLJAX_SFT_CACHE or none)"),
    # --- reward_model: launch.train_reward_model (Bradley-Terry) ---
    "reward_model.num_steps": F(1000, "int>=1", "optimizer steps"),
    "reward_model.batch_size": F(32, "int>=1", "pairs per step"),
    "reward_model.learning_rate": F(3e-4, ">0", "peak learning rate (AdamW, "
                                    "cosine)"),
    "reward_model.center_coef": F(0.0, ">=0", "TRL's center_rewards_"
                                  "coefficient: + c * mean((r_c + r_r)^2)"),
    "reward_model.init": F("sft", None, "the decoder: an sft.* warm-up of "
                           "its own, the policy's (the same initial params "
                           "and SFT as launch.train of this config and seed)"
                           ", or fresh",
                           choices=("sft", "policy_sft", "scratch")),
    "reward_model.pairs_path": F("", None, "JSONL of prompt/chosen/rejected"
                                 "[/margin] ('': built from the task)"),
    "reward_model.heldout_path": F("", None, "held-out pairs JSONL ('': the "
                                   "head of pairs_path)"),
    "reward_model.negatives": F("mixed", None, "built-in pairs' rejected "
                                "answers: near misses, random integers and "
                                "digit edits; or near misses only",
                                choices=("mixed", "near")),
    "reward_model.policy_prompts": F(0, "int>=0", "also pairs of the SFT "
                                     "model's own samples on this many "
                                     "prompts, labelled by the labeller"),
    "reward_model.policy_samples": F(8, "int>=1", "samples per such prompt"),
    "reward_model.policy_path": F("", None, "sample those pairs from this "
                                  "run's latest policy (an rljax run "
                                  "directory) instead of the SFT model: "
                                  "iterated RLHF"),
    "reward_model.init_path": F("", None, "start from this reward model (a "
                                "reward-model run or Hugging Face directory) "
                                "instead of a fresh head on the SFT model: "
                                "iterated RLHF"),
    "reward_model.labeller": F("numeric_match", None, "the reward that labels "
                               "them (>= 1: right)"),
    "reward_model.num_pairs": F(8000, "int>=1", "built-in training pairs"),
    "reward_model.num_heldout": F(256, "int>=1", "held-out pairs"),
    "reward_model.max_length": F(16, "int>=1", "padded length of one side"),
    "reward_model.eval_every": F(100, "int>=1", "held-out pair accuracy cadence"),
    "reward_model.checkpoint_every": F(100, "int>=1", "checkpoint cadence"),
    # --- preference: the DPO family instead of RL (rljax/train/preference.py)
    "preference.loss": F("", None, "'' trains RL; a name of "
                         "PREFERENCE_LOSSES (dpo, robust_dpo, ipo, simpo, "
                         "orpo, kto) trains rl.num_steps steps on pairs"),
    "preference.beta": F(0.1, ">0", "the implicit reward's scale (ORPO: "
                         "the odds-ratio term's weight lambda)"),
    "preference.label_smoothing": F(0.0, "[0,0.5)", "assumed label-flip "
                                    "rate (cDPO, robust DPO, SimPO)"),
    "preference.simpo_gamma": F(0.5, ">=0", "SimPO's target reward margin"),
    "preference.nll_coef": F(0.0, ">=0", "+ this x the chosen side's "
                             "token-mean NLL (RPO; CPO's alpha)"),
    "preference.desirable_weight": F(1.0, ">0", "KTO: weight of desirable "
                                     "completions"),
    "preference.undesirable_weight": F(1.0, ">0", "KTO: weight of "
                                       "undesirable completions"),
    "preference.batch_size": F(32, "int>=1", "pairs per step"),
    "preference.pairs_path": F("", None, "JSONL of prompt/chosen/rejected "
                               "('': built from the task)"),
    "preference.heldout_path": F("", None, "held-out pairs JSONL ('': the "
                                 "head of pairs_path)"),
    "preference.negatives": F("mixed", None, "built-in pairs' rejected "
                              "answers (as reward_model.negatives)",
                              choices=("mixed", "near")),
    "preference.num_pairs": F(4000, "int>=1", "built-in training pairs"),
    "preference.num_heldout": F(256, "int>=1", "held-out pairs"),
    "preference.max_length": F(16, "int>=1", "padded row length (prompt + "
                               "completion + EOS)"),
    "preference.reference": F("", None, "'': the policy as the run starts "
                              "(LoRA: the frozen base); or a run directory "
                              "or Hugging Face checkpoint"),
    "preference.precompute_reference": F(False, None, "the reference's "
                                         "log-probabilities of every pair "
                                         "computed once at the start"),
    "preference.padding_free": F(True, None, "rows packed, real tokens only"),
    "preference.online": F(False, None, "pairs sampled from the current "
                           "policy each step (rl.prompts_per_step x "
                           "rl.group_size), best over worst by the rewards"),
    "preference.online_top_fraction": F(1.0, "(0,1]", "online: the "
                                        "fraction of the step's pairs that "
                                        "train, those whose best - worst "
                                        "score gap is largest (1: all)"),
    # --- rl: the batch ---
    "rl.num_steps": F(100, "int>=1", "RL steps"),
    "rl.prompts_per_step": F(32, "int>=1", "prompts per step (B)"),
    "rl.group_size": F(8, "int>=1", "trained samples per prompt (G)"),
    "rl.num_epochs": F(1, "int>=1", "passes over a rollout batch"),
    "rl.num_minibatches": F(1, "int>=1", "optimizer updates per epoch"),
    "rl.num_microbatches": F(1, "int>=1", "accumulation chunks per update"),
    # --- rl: how rollouts are scheduled (docs/rollouts.md) ---
    "rl.rollout": F("static", None, "static batch, continuous batching on "
                    "slots, partial rollouts (APRIL), tree rollouts "
                    "(TreePO: rl.tree.*), or lookahead tree rollouts "
                    "branching at uncertain tokens (LATR: rl.latr.*)",
                    choices=("static", "continuous", "partial", "tree",
                             "latr")),
    "rl.rollout_slots": F(None, "int>=1?", "continuous / partial: rows "
                          "decoded at once (None: half the step's rows)", int),
    "rl.rollout_refill_rows": F(None, "int>=1?", "rows prefilled per refill "
                                "(None: a quarter of the slots)", int),
    "rl.partial_max_age": F(2, "int>=1", "partial: a carried group older "
                            "than this many steps is dropped"),
    "rl.partial_max_carried": F(0.5, "[0,1]", "partial: groups carried to "
                                "the next step, at most this fraction of "
                                "rl.prompts_per_step"),
    "rl.tree.segment_tokens": F(4, "int>=1", "tree: tokens decoded between "
                                "two forks"),
    "rl.tree.branch": F(2, "int>=2", "tree: each fork multiplies a prompt's "
                        "rows by this"),
    "rl.tree.roots": F(2, "int>=1", "tree: a prompt's rows before the first "
                       "fork (roots x branch^D = the rows per prompt)"),
    "rl.tree.branch_by": F("uncertainty", None, "tree: a fork's new rows go "
                           "to the live rows by their last segment's mean "
                           "surprisal, or equally",
                           choices=("uncertainty", "uniform")),
    "rl.latr.mix_ratio": F(1.0, "[0,1]", "latr: the share of a prompt's rows "
                           "grown as its tree (the rest sampled as usual)"),
    "rl.latr.abs_threshold": F(0.15, "[0,1]", "latr: a token branches when "
                               "its second candidate's probability p2 is "
                               "above this"),
    "rl.latr.rel_threshold": F(0.25, "[0,1]", "latr: and p1 - p2 is above "
                               "this"),
    "rl.latr.lookahead": F((30, 50), None, "latr: a branch is compared with "
                           "its parent this many tokens after its birth"),
    "rl.latr.edit_distance": F(0.4, "[0,1]", "latr: a branch within this "
                               "fraction of edits of its parent's last k "
                               "tokens is pruned"),
    # --- rl.selection: which prompts are sampled and trained (docs/selection.md)
    "rl.selection.name": F("none", None, "dapo: drop zero-variance groups "
                           "and refill; greso: also skip prompts predicted "
                           "uninformative before sampling; dots: prompts of "
                           "predicted success near dots_target",
                           choices=("none", "dapo", "greso", "dots")),
    "rl.selection.max_rounds": F(3, "int>=1", "sampling rounds per step at "
                                 "most, the first included (1: no refill)"),
    "rl.selection.greso_target": F(0.125, "(0,1)", "GRESO: each kind's "
                                   "(easy, hard) target share of a step's "
                                   "groups"),
    "rl.selection.greso_step_size": F(0.01, "(0,1]", "GRESO: exploration "
                                      "probability change per step"),
    "rl.selection.greso_min_explore": F(0.05, "(0,1]", "GRESO: the "
                                        "exploration probabilities' floor"),
    "rl.selection.greso_max_draws": F(4, "int>=1", "GRESO: prompt batches "
                                      "drawn per round at most"),
    "rl.selection.dots_every": F(8, "int>=1", "DOTS: steps per selection "
                                 "round"),
    "rl.selection.dots_reference": F(64, "int>=1", "DOTS: reference prompts "
                                     "rolled out per round (a multiple of "
                                     "rl.prompts_per_step)"),
    "rl.selection.dots_target": F(0.5, "(0,1)", "DOTS: the success rate "
                                  "aimed at"),
    "rl.selection.dots_temperature": F(0.1, ">0", "DOTS: of the selection "
                                       "softmax over -|p_hat - target|"),
    "rl.selection.dots_attention_temperature": F(
        0.05, ">0", "DOTS: of the attention over the reference set"),
    # --- rl.allocation: how many samples each prompt gets (docs/selection.md)
    "rl.allocation.name": F("none", None, "vigor: rounds, more samples to "
                            "the prompts of highest reward variance; "
                            "pilot_commit: a pilot round, the rest to the "
                            "most varied prompts; sgpo: a profiled "
                            "curriculum, group sizes ~ 1/success",
                            choices=("none", "vigor", "pilot_commit",
                                     "sgpo")),
    "rl.allocation.rounds": F(4, "int>=1", "VIGOR: sampling rounds per step "
                              "(rl.group_size / rounds samples each first)"),
    "rl.allocation.growth": F(2, "int>=1", "VIGOR: 1/growth of the prompts "
                              "stay each round, with growth x the samples"),
    "rl.allocation.pilot_fraction": F(0.25, "(0,1)", "Pilot-Commit: share "
                                      "of the budget spent on the pilot"),
    "rl.allocation.commit_fraction": F(0.25, "(0,1]", "Pilot-Commit: share "
                                       "of the prompts the rest goes to"),
    "rl.allocation.profile_samples": F(4, "int>=1", "sGPO: samples per "
                                       "training prompt in the profiling "
                                       "pass"),
    "rl.allocation.max_group": F(32, "int>=1", "sGPO: the largest group"),
    "rl.allocation.unsolved_keep": F(0.25, "[0,1]", "sGPO: share of the "
                                     "never-solved prompts kept"),
    "rl.replay.fraction": F(0.0, "[0,1)", "share of each step's groups "
                            "replayed from recent informative ones instead "
                            "of sampled (0: off)"),
    "rl.replay.max_age": F(4, "int>=1", "replay: a stored group older than "
                           "this many updates is dropped"),
    "rl.replay.capacity": F(256, "int>=1", "replay: groups stored at most"),
    "rl.max_staleness": F(0, "int>=0", "asynchronous: sample up to k steps "
                          "ahead with older params (0: synchronous)"),
    "rl.sampler_devices": F(0, "int>=0", "the last n devices only sample, "
                            "the others train; params are published to them "
                            "after each update (0: one mesh shared in time)"),
    # --- rl: the algorithm's names (their entries: rljax/train/table.py) ---
    "rl.advantage": F("grpo", None, "a preset or links joined with '+'"),
    "rl.objective": F("ppo_clip", None, "the per-token coefficient"),
    "rl.is_correction": F("none", None, "sampler-mismatch correction"),
    "rl.aggregation": F("token_mean", None, "loss aggregation"),
    "rl.kl_estimator": F("k3", None, "the KL term's estimator"),
    "rl.rejection": F("", None, "verl's rollout rejection, e.g. "
                      "'seq_sum_k1:0.5:2.0' ('': off)"),
    # --- rl: conventions shared by many names (docs/conventions.md) ---
    "rl.advantage_clip": F(None, ">0?", "clip the advantages last", float),
    "rl.std_eps": F(None, ">=0?", "epsilon added to every std (None: each "
                    "chain's own, 1e-6 as verl; TRL: 1e-4)", float),
    "rl.singleton_groups": F("zero", None, "a group with one valid sample: "
                             "advantage 0 (TRL) or its reward (verl)",
                             choices=("zero", "raw")),
    "rl.failed_rewards": F("exclude", None, "a row whose every reward failed: "
                           "out of the statistics (TRL) or scored 0",
                           choices=("exclude", "zero")),
    "rl.clip_eps_low": F(0.2, ">0", "PPO clip: 1 - eps_low"),
    "rl.clip_eps_high": F(0.28, ">0", "PPO clip: 1 + eps_high (DAPO)"),
    "rl.is_cap": F(2.0, ">0", "tis / mis: the weight's cap"),
    "rl.is_floor": F(None, ">0?", "tis: lower bound of the weight", float),
    "rl.is_batch_normalize": F(False, None, "tis: divide the weights by "
                               "their mean"),
    "rl.is_level": F("token", None, "tis / mis: token or sequence weights",
                     choices=("token", "sequence")),
    "rl.count_empty_sequences": F(False, None, "the sequence normaliser "
                                  "counts every row (TRL grpo)"),
    "rl.max_log_ratio": F(20.0, ">0", "clamp of the log-ratio (verl 20)"),
    "rl.padding_free": F(True, None, "the step's forward passes run on "
                         "packed rows, real tokens only (the same loss; "
                         "False: padded rows)"),
    "rl.microbatch_tokens": F(0, "int>=0", "0: microbatches of consecutive "
                              "rows; > 0: split each minibatch by tokens, "
                              "the fewest microbatches within this budget "
                              "(verl's dynamic batch size; padding-free)"),
    "rl.packing_buckets": F(8, "int>=1", "padding-free: the buffer counts "
                            "a microbatch may compile; more fill the "
                            "buffers closer to the real tokens and compile "
                            "more step programs"),
    "rl.kl_coef": F(0.0, ">=0", "weight of the KL to the reference params"),
    "rl.log_kl": F(False, None, "log the KL to the reference params (kl) "
                   "with no penalty: a copy of the SFT params is kept; the "
                   "loss and its gradient are those without it"),
    "rl.kl_target": F(None, ">0?", "adapt rl.kl_coef to hold this KL "
                      "(Ziegler et al. 2019; None: fixed)", float),
    "rl.kl_horizon": F(10000, "int>=1", "the adaptive KL controller's "
                       "horizon in rows (TRL's default)"),
    "rl.entropy_coef": F(0.0, ">=0", "weight of the entropy bonus"),
    "rl.training_temperature": F(1.0, ">0", "logits are divided by it"),
    "rl.old_logprobs": F("recompute", None, "pi_old: the trainer's forward "
                         "pass or the sampler's logprobs (verl's bypass)",
                         choices=("recompute", "sampler")),
    "rl.ess_pooling": F("microbatch", None, "FeynRL's token ESS pooled per",
                        choices=("microbatch", "minibatch")),
    "rl.ess_kl_coef": F(None, ">=0?", "the (1 - ESS) pull toward the "
                        "sampler (None: 1 with objective=ess, else 0)", float),
    "rl.distill_coef": F(0.0, ">=0", "on-policy distillation: weight of the "
                         "per-token reverse KL to teacher.path"),
    # --- critic (read with rl.advantage="gae") ---
    "critic.gamma": F(1.0, "[0,1]", "GAE discount"),
    "critic.lam": F(1.0, "[0,1]", "GAE lambda"),
    "critic.value_clip": F(0.5, ">0?", "verl's cliprange_value (None: off)",
                           float),
    "critic.whiten": F(True, None, "whiten the advantages over the batch"),
    "critic.learning_rate": F(1e-5, ">0", "the critic's Adam learning rate"),
    "critic.max_grad_norm": F(1.0, ">0?", "the critic's gradient clip", float),
    # --- teacher (read with rl.distill_coef > 0) ---
    "teacher.path": F("", None, "an rljax run or a Hugging Face checkpoint"),
    "teacher.step": F(None, "int>=0?", "the run's checkpoint (latest if "
                      "None)", int),
    "teacher.temperature": F(1.0, ">0", "the teacher's logits are divided by it"),
    # --- optimizer ---
    "optimizer.name": F("adamw", None, "the optax optimizer",
                        choices=("adamw", "adam", "sgd", "lion")),
    "optimizer.learning_rate": F(1e-6, ">0", "peak learning rate"),
    "optimizer.warmup_steps": F(0, "int>=0", "linear warm-up updates"),
    "optimizer.schedule": F("constant", None, "after the warm-up",
                            choices=("constant", "cosine")),
    "optimizer.final_lr_fraction": F(0.1, "[0,1]", "cosine: final / peak"),
    "optimizer.weight_decay": F(0.0, ">=0", "decoupled weight decay"),
    "optimizer.b1": F(None, "[0,1)?", "Adam / Lion beta1 (None: optax's)",
                      float),
    "optimizer.b2": F(None, "[0,1)?", "Adam / Lion beta2 (None: optax's)",
                      float),
    "optimizer.max_grad_norm": F(1.0, ">0?", "global-norm gradient clip",
                                 float),
    "optimizer.ess_scaling": F(None, None, "VCPO: scale the step by the "
                               "sequence-level ESS", str,
                               choices=(None, "sqrt", "linear")),
    "optimizer.max_consecutive_nonfinite": F(
        5, "int>=1?", "stop after this many skipped updates in a row", int),
    # --- rewards ---
    "rewards.names": F(("numeric_match",), None,
                       "built-in names or 'package.module:function'"),
    "rewards.weights": F((1.0,), None, "one weight per reward function"),
    "rewards.num_workers": F(2, "int>=0", "reward processes (0: inline)"),
    "rewards.timeout_s": F(10.0, ">0", "per call"),
    "rewards.clip": F(None, ">0?", "finite rewards beyond +-clip are clipped",
                      float),
    "rewards.memory_limit_mb": F(None, "int>=1?", "per reward worker, over "
                                 "its start-up size", int),
    "rewards.max_failure_fraction": F(0.99, "[0,1]", "stop when more (sample, "
                                      "reward) pairs fail ..."),
    "rewards.failure_patience": F(5, "int>=1", "... for this many steps"),
    "rewards.models.tokens": F("auto", None, "a 'model:<path>' reward reads "
                               "the policy's tokens (same tokenizer) or the "
                               "text", choices=("auto", "policy", "text")),
    "rewards.models.chat_template": F(True, None, "text read through the "
                                      "reward model's chat template"),
    "rewards.judges.template": F(
        "Question: {prompt}\nAnswer: {completion}\nIs the answer correct? "
        "Reply yes or no.\nVerdict: ", None, "a 'judge:<path>' reward's "
        "prompt ({prompt}, {completion})"),
    "rewards.judges.max_new_tokens": F(8, "int>=1", "verdict tokens at most"),
    "rewards.judges.num_samples": F(1, "int>=1", "verdicts per completion "
                                    "(1: greedy; more: sampled, majority)"),
    "rewards.judges.temperature": F(1.0, ">0", "of sampled verdicts"),
    "rewards.judges.parser": F("", None, "verdict -> score: '' (yes/no or a "
                               "number) or 'package.module:function'"),
    "rewards.judges.chat_template": F(True, None, "the judge prompt as a user "
                                      "turn of its chat template"),
    "rewards.ensemble.aggregation": F(
        "mean_minus_std", None, "an 'ensemble:<path>,<path>' reward: the "
        "members' mean, their worst, or mean - k std",
        choices=("mean", "worst", "mean_minus_std")),
    "rewards.ensemble.k": F(1.0, ">=0", "the std's weight of "
                            "mean_minus_std"),
    "rewards.models.param_dtype": F("", None, "reward-model params' dtype "
                                    "('': the checkpoint's)",
                                    choices=("", "float32", "bfloat16")),
    # --- env: multi-turn environments (docs/environments.md) ---
    "env.name": F("", None, "a built-in environment or "
                  "'package.module:factory' ('': single-turn)"),
    "env.kwargs": F({}, None, "keyword arguments of the environment"),
    "env.max_turns": F(4, "int>=1", "model turns per episode"),
    "env.max_observation_tokens": F(16, "int>=1", "an observation is cut "
                                    "to this many tokens"),
    "env.max_turn_tokens": F(None, "int>=1?", "tokens of one model turn "
                             "(None: the episode's budget)", int),
    "env.step_rows": F(None, "int>=1?", "step the environments once this "
                       "many rows wait (their latency overlaps the others' "
                       "decoding; None: turn by turn)", int),
    "env.observation_role": F("user", None, "chat role of observations "
                              "(chat templates only)"),
    "env.num_workers": F(2, "int>=0", "environment processes (0: inline)"),
    "env.timeout_s": F(10.0, ">0", "per reset or step call"),
    "env.memory_limit_mb": F(None, "int>=1?", "per environment worker, over "
                             "its start-up size", int),
    # --- eval ---
    "eval.every": F(50, "int>=0", "held-out evaluation cadence (RL steps); "
                    "0: none, not even before and after RL"),
    "eval.num_examples": F(256, "int>=1", "held-out prompts"),
    "eval.num_samples": F(1, "int>=1", "samples per held-out prompt"),
    "eval.greedy": F(True, None, "also evaluate greedy decoding"),
    "eval.reward": F("", None, "the reward that counts as correct "
                     "(default: the first)"),
    # --- checkpoint ---
    "checkpoint.every": F(50, "int>=1", "checkpoint cadence (RL steps)"),
    "checkpoint.max_to_keep": F(2, "int>=1?", "newest checkpoints kept", int),
    "checkpoint.best_metric": F("", None, "also keep the best by this metric"),
    "checkpoint.best_mode": F("max", None, "of best_metric",
                              choices=("max", "min")),
    # --- metrics: where they are written (rljax/metrics.py, tracking.py) ---
    "metrics.writers": F(("jsonl", "tensorboard"), None, "jsonl (required), "
                         "tensorboard, wandb, mlflow (the last two: extras)"),
    "metrics.histogram_every": F(10, "int>=0", "per-row advantages, rewards, "
                                 "lengths, log-ratios as histograms every k "
                                 "steps (0: never)"),
    "metrics.wandb.project": F("rljax", None, "W&B project"),
    "metrics.wandb.entity": F("", None, "W&B entity ('': the default)"),
    "metrics.wandb.mode": F("", None, "'': WANDB_MODE (else online)",
                            choices=("", "online", "offline")),
    "metrics.wandb.name": F("", None, "W&B run name ('': generated)"),
    "metrics.mlflow.tracking_uri": F("", None, "'': $MLFLOW_TRACKING_URI, "
                                     "else sqlite in the run directory"),
    "metrics.mlflow.experiment": F("rljax", None, "MLflow experiment name"),
    "metrics.mlflow.name": F("", None, "MLflow run name ('': the run "
                             "directory's)"),
}


def _merged() -> dict[str, Field]:
  fields = dict(_BASE)
  for name, field in table.entry_fields().items():
    if name in fields and fields[name] != field:
      raise ValueError(f"{name} is declared twice, differently.")
    fields[name] = field
  return fields


FIELDS: dict[str, Field] = {}
"""Every field, filled on first use (``fields()``)."""


def fields() -> dict[str, Field]:
  """``FIELDS``: the base fields and those of every table entry."""
  if not FIELDS:
    FIELDS.update(_merged())
  return FIELDS


def default(name: str) -> Any:
  """The default of ``"section.field"`` (a copy, for mutable defaults)."""
  return copy.deepcopy(fields()[name].default)


def section_defaults(section: str) -> dict[str, Any]:
  """``{field: default}`` of one section."""
  prefix = section + "."
  return {k[len(prefix):]: default(k) for k in fields() if k.startswith(prefix)}


def complete(section: str, values: Mapping[str, Any] | None) -> dict[str, Any]:
  """A section's values with every missing field at its default."""
  out = section_defaults(section)
  out.update(dict(values or {}))
  return out


def base_config() -> ml_collections.ConfigDict:
  """A ConfigDict of every field at its default (``configs/common.base``)."""
  c = ml_collections.ConfigDict()
  for name, field in fields().items():
    *path, leaf = name.split(".")
    node = c
    for part in path:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    if field.default is None:
      node[leaf] = ml_collections.config_dict.placeholder(field.type)
    elif isinstance(field.default, dict):
      node[leaf] = ml_collections.ConfigDict(dict(field.default))
    else:
      node[leaf] = field.default
  return c


def complete_config(config: Any) -> ml_collections.ConfigDict:
  """A copy of ``config`` (a ConfigDict or a nested dict, e.g. an older run's
  ``config.json``) with every field it lacks at its default."""
  merged = base_config().to_dict()
  values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  names = fields()

  def fill(into: dict[str, Any], values: Mapping[str, Any], prefix: str):
    for key, value in values.items():
      name = prefix + key
      if (isinstance(value, Mapping) and isinstance(into.get(key), dict)
          and name not in names):  # a section (model.lora), not a dict field
        fill(into[key], value, name + ".")
      else:
        into[key] = value

  fill(merged, values, "")
  return ml_collections.ConfigDict(merged)
