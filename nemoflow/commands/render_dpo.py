"""``nemoflow render-dpo``: write NeMo-RL's DPO config and its Slurm launch (Ray head + workers), never run here."""

from __future__ import annotations

import os

from nemoflow.commands import add_command

DESCRIPTION = """\
Write what the seeds' `sbatch launch.sh --cluster_type ... --job_script algorithms/dpo.sh` submits,
for NeMo-RL's DPO (preference alignment), into --out:

  dpo.yaml      NeMo-RL's DPO config, checked against NeMo-RL's own schema (infra/nemo_rl_dpo_schema.json)
  dpo.sbatch    one allocation; a Ray head on the first node and a worker on every other, in the
                NeMo-RL container (pyxis), the preset's NCCL environment; the driver examples/run_dpo.py.
                Output: <out>/<job_id>/checkpoints, <out>/<job_id>/ray-logs/, <out>/<job_id>/nemo_rl_output.log
  prefs.jsonl   with --demo-data: KJV preference pairs (prompt, chosen, rejected)

  nemoflow render-dpo --model /shared/models/sft-1 --data /shared/prefs.jsonl --preset hcc-a3m --nodes 2 \\
      --container /shared/nemo-rl.sqsh --out /shared/dpo
  sbatch /shared/dpo/dpo.sbatch

NeMo-RL needs Python >= 3.13 and GPUs: nemoflow renders this job but has never run it."""


def register(sub) -> None:
    parser = add_command(
        sub, "render-dpo", "write NeMo-RL's DPO config and Slurm launch (Ray head + workers), for sbatch", DESCRIPTION
    )
    parser.add_argument("--model", required=True, help="the model to align: a Hugging Face directory or hub id")
    parser.add_argument("--data", help="preference JSONL (prompt, chosen, rejected) on shared storage")
    parser.add_argument("--validation-data", help="held-out preference JSONL")
    parser.add_argument("--demo-data", action="store_true", help="write KJV preference pairs to <out>/prefs.jsonl")
    parser.add_argument("--out", required=True, help="shared directory: the files, and each job's <job_id>/ output")
    parser.add_argument("--preset", help="cluster type: partition, GPUs per node, NCCL env (infra/slurm/options.py)")
    parser.add_argument("--gpus", type=int, help="GPUs per node (default: the preset's, else 8)")
    launch_options().add_to(parser)  # --nodes --partition --account --time --container --mount
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--beta", type=float, default=0.05, help="reference_policy_kl_penalty (DPO's beta)")
    parser.add_argument("--wandb-project", help="log to W&B (WANDB_API_KEY from sbatch's environment)")
    parser.set_defaults(func=run)


def launch_options():
    """Where the job runs: the fields of :class:`~infra.nemo_rl.RayLaunch` a user sets."""
    from infra import nemo_rl
    from nemoflow.options import ModelOptions, Option

    return ModelOptions(
        nemo_rl.RayLaunch,
        # the rest: GPUs and the output directory are --gpus and --out, the files' paths follow from --out
        exclude={"job_name", "gpus_per_node", "qos", "out_dir", "config_path", "nemo_rl_dir", "ray_port"}
        | {"ray_ready_timeout_s"},
        fields={"mounts": Option("--mount", repeat=True)},
    )


def build(args) -> dict[str, str]:
    """File name -> text."""
    import yaml

    from infra import nemo_rl
    from infra.slurm.options import PRESETS
    from workloads import chat_data

    if args.preset and args.preset not in PRESETS:
        raise ValueError(f"unknown --preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    out = os.path.abspath(args.out)
    files: dict[str, str] = {}
    data = args.data
    if args.demo_data:
        data = os.path.join(out, "prefs.jsonl")
        files["prefs.jsonl"] = "".join(
            __import__("json").dumps(r, ensure_ascii=False) + "\n" for r in chat_data.kjv_preference_rows()
        )
    if not data:
        raise ValueError("--data (a preference JSONL) or --demo-data is required")
    gpus = args.gpus or (PRESETS[args.preset].gpus_per_node if args.preset else 8)
    data_dirs = sorted({os.path.dirname(os.path.abspath(p)) for p in (data, args.validation_data) if p})
    options = launch_options()
    mounts = [*options.given(args).get("mounts", []), *(f"{d}:{d}:ro" for d in data_dirs if d != out)]
    if os.path.isabs(args.model):
        mounts.append(f"{args.model}:{args.model}:ro")
    launch = options.build(
        args, gpus_per_node=gpus, mounts=mounts, out_dir=out, config_path=os.path.join(out, "dpo.yaml")
    )
    config = nemo_rl.DpoConfig(
        policy=nemo_rl.Policy(
            model_name=args.model,
            tokenizer=nemo_rl.Tokenizer(name=args.model),
            train_global_batch_size=args.global_batch_size,
            train_micro_batch_size=args.micro_batch_size,
            max_total_sequence_length=args.seq_length,
            optimizer=nemo_rl.Optimizer(
                kwargs={**nemo_rl.Optimizer().kwargs, "lr": args.lr},
            ),
        ),
        data=nemo_rl.Data(
            max_input_seq_length=args.seq_length,
            train=nemo_rl.PreferenceData(data_path=data),
            validation=nemo_rl.PreferenceData(data_path=args.validation_data or data),
        ),
        dpo=nemo_rl.DpoSection(max_num_steps=args.max_steps, reference_policy_kl_penalty=args.beta),
        logger=nemo_rl.Logger(
            wandb_enabled=bool(args.wandb_project),
            wandb=nemo_rl.WandbSection(project=args.wandb_project or "nemoflow-dpo"),
        ),
        cluster=nemo_rl.Cluster(gpus_per_node=gpus, num_nodes=launch.nodes),
    ).to_nemo_rl()
    nemo_rl.check_config(config)
    files["dpo.yaml"] = (
        "# NeMo-RL DPO config, rendered by nemoflow (checked against NeMo-RL's schema)\n"
        + yaml.safe_dump(config, sort_keys=False)
    )
    files["dpo.sbatch"] = nemo_rl.render_sbatch(launch, args.preset)
    return files


def run(args) -> int:
    from nemoflow.commands.render import write_files

    for path in write_files(build(args), args.out):
        print(path)
    print(f"submit with: sbatch {os.path.join(os.path.abspath(args.out), 'dpo.sbatch')}")
    return 0
