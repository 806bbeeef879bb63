"""The `flexorch` command."""

from __future__ import annotations

import argparse
import shlex
import sys
import tomllib
from pathlib import Path

from flexorch.cli.dashboard import add_dashboard_parser, cmd_dashboard
from flexorch.cli.plan_window import add_window_flags, with_window
from flexorch.cli.prepare import add_prepare_parser, cmd_prepare
from flexorch.data.errors import DataError
from flexorch.data.lengths import parse_tokens

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flexorch", description="Per-step adaptive sequence parallelism on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="show the per-step plans for real batches of a corpus")
    _plan_flags(plan)

    train = sub.add_parser("train", help="train a model with a new SP plan every step (Ray driver + worker actors)")
    _train_flags(train)
    calib = sub.add_parser("profile", help="calibrate the cost model on the workers and write a profile JSON")
    _train_flags(calib)
    calib.add_argument("--out", type=Path, default=Path("runs/profile.json"), help="profile file to write")

    add_prepare_parser(sub)

    add_dashboard_parser(sub)

    prof = sub.add_parser("profiles", help="list the built-in cost-model profiles, or print one as JSON")
    prof.add_argument("name", nargs="?", help="profile name or JSON file to print")

    export = sub.add_parser(
        "export",
        help="consolidate a checkpoint (sharded or not): one model file, or for a Hugging Face model ([model] hf) a "
        "directory that AutoModelForCausalLM.from_pretrained loads, with each task's LoRA adapter as a PEFT adapter "
        "in adapters/<task>/",
    )
    export.add_argument(
        "checkpoint",
        help="a checkpoint directory, a run directory or a checkpoint storage (its newest complete checkpoint); local, "
        "s3:// or gs://",
    )
    export.add_argument(
        "out", type=Path, help="the file to write (torch.save of the state dict), or the directory (HF model)"
    )
    return p


def _plan_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `flexorch plan`."""
    p.add_argument("--config", type=Path, help="TOML file whose keys are these flags (flags win)")
    p.add_argument(
        "--lengths",
        type=Path,
        help="lengths file, .jsonl file or directory (default: bundled Wikipedia lengths)",
    )
    p.add_argument("--text-field", help="JSONL field with the text (default: text)")
    p.add_argument("--workers", type=int, help="N workers, one per device slot (a GPU) (default 64)")
    p.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # renamed --workers: refused, see _merged
    p.add_argument("--profile", help="built-in profile name or profile JSON file (default gpt-7b-a100)")
    p.add_argument("--heads", type=int, help="override the profile's attention heads (Ulysses needs d | heads)")
    add_window_flags(p)
    p.add_argument("--max-context", help="longest sequence in tokens, e.g. 384K (default: what N devices hold)")
    p.add_argument("--over-long", choices=["drop", "reject"], help="sequences over --max-context (default drop)")
    p.add_argument("--batch", type=int, help="sequences per global batch (default 512)")
    p.add_argument("--steps", type=int, help="steps to plan (default 10)")
    p.add_argument("--seed", type=int, help="batch shuffle seed (default 0)")
    p.add_argument("--time-limit", type=float, help="planner budget per step, seconds (default 1.0)")
    p.add_argument("--solver-workers", type=int, help="processes solving micro-batches in parallel (default 1)")
    p.add_argument("--json", action="store_true", default=None, help="one JSON object per step")
    p.add_argument("--svg", type=Path, help="write a picture of every step (workers x time) to this file")
    p.add_argument(
        "--run-dir", type=Path, help="write every step's record to RUN_DIR/steps.jsonl (see: flexorch dashboard)"
    )
    p.add_argument(
        "--pipeline-stages",
        metavar="P|auto",
        help="plan each step as a pipeline of P stages (workers // P per stage, SP inside a stage) or 'auto' (the "
        "best split per step), against 1F1B and Seq1F1B, instead of SP groups",
    )
    p.add_argument(
        "--gpus-per-node", type=int, help="workers per node (the last node holds what is left): plan on nodes"
    )
    p.add_argument("--nodes", help="live workers per node in rank order, e.g. 8,8,7 (default: one node)")
    p.add_argument(
        "--topology",
        choices=["aware", "blind"],
        help="with nodes: 'aware' (default) places and prices groups by node; 'blind' plans as one node",
    )
    p.add_argument(
        "--speeds",
        help="simulate slow or fast workers: one relative speed per worker (1,1,0.5,1), RANK=SPEED (3=0.5, others "
        "1.0) or NODE=SPEED (node1=0.7, with --nodes); plans are priced with them, beside the speed-blind plan",
    )


def _train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML run file (see examples/train_laptop.toml); flags win")
    p.add_argument("--steps", type=int, help="total steps of the run (default 20)")
    p.add_argument("--workers", type=int, help="worker actors, one per device slot: a GPU or a CPU slot (default 4)")
    p.add_argument("--data", help="directory of text/code files, .jsonl or .parquet (default: Python's stdlib)")
    p.add_argument("--run-dir", help="records, profile and checkpoints go here (default runs/train)")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the newest checkpoint in storage")
    p.add_argument("--batch-size", type=int, help="documents per global batch (default 16)")
    p.add_argument("--seed", type=int, help="model init and data order seed (default 0)")
    p.add_argument("--mode", help="'adaptive' (default) or a static layout such as static-ulysses-2")
    p.add_argument("--profile", help="'auto' (calibrate at start, default), a built-in name or a profile JSON")
    p.add_argument("--max-context", help="longest document in tokens, e.g. 2K (default 2048)")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (default: only at the end)")
    p.add_argument(
        "--checkpoint-storage",
        help="[checkpoint] storage: a directory, s3:// or gs:// prefix (default RUN_DIR/checkpoints)",
    )
    p.add_argument(
        "--min-workers", type=int, help="[elastic] min_workers: below it, wait for capacity (default: derived)"
    )
    p.add_argument("--max-workers", type=int, help="[elastic] max_workers: grow onto joining nodes up to it")
    p.add_argument(
        "--pipeline-stages",
        type=_stages_arg,
        help="[pipeline] stages: split the layers over P stages (workers // P per stage), or 'auto'; 1 (default): "
        "SP only",
    )
    p.add_argument(
        "--pipeline-params",
        choices=("stage", "replicated"),
        help="[pipeline] params: each worker holds its stage's parameters ('stage', default) or the whole model",
    )
    p.add_argument(
        "--sharding",
        choices=("replicate", "fsdp", "hsdp"),
        help="[sharding] mode: whole replicas, FSDP2 over the world, or sharded within --shard-size groups "
        "(default: fsdp on GPU, replicate on CPU)",
    )
    p.add_argument("--shard-size", type=int, help="[sharding] shard_size: workers per shard group (hsdp)")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="[sharding] precision (default: bf16 on GPU)")
    p.add_argument(
        "--activation-checkpointing",
        choices=("none", "full", "selective", "auto"),
        help="[sharding] activation_checkpointing: recompute each decoder layer (full) or its MLP (selective); "
        "auto: per micro-batch and SP group, none where it fits the memory budget, else selective or full; with "
        "pipeline stages the layers their ILP picks (default: auto on GPU workers and with stages, none otherwise)",
    )
    p.add_argument(
        "--dashboard-port", type=int, help="also serve the plan viewer for this run on 127.0.0.1:PORT (0: any port)"
    )


def _train_config(args: argparse.Namespace):
    from flexorch.config import load_train_config

    overrides = {
        "steps": args.steps,
        "workers": args.workers,
        "run_dir": args.run_dir,
        "resume": args.resume,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "checkpoint_every": args.checkpoint_every,
        "checkpoint.storage": getattr(args, "checkpoint_storage", None),
        "elastic.min_workers": args.min_workers,
        "elastic.max_workers": args.max_workers,
        "data.source": args.data,
        "data.max_context": parse_tokens(args.max_context) if args.max_context else None,
        "plan.mode": args.mode,
        "plan.profile": args.profile,
        "pipeline.stages": args.pipeline_stages,
        "pipeline.params": getattr(args, "pipeline_params", None),
        "sharding.mode": getattr(args, "sharding", None),
        "sharding.shard_size": getattr(args, "shard_size", None),
        "sharding.precision": getattr(args, "precision", None),
        "sharding.activation_checkpointing": getattr(args, "activation_checkpointing", None),
    }
    return load_train_config(args.config, overrides)


def _stages_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of stages or 'auto', got {value!r}") from None


def _preflight(cfg) -> None:
    """The run's checks that need no worker, before Ray starts (``flexorch.cli.preflight``)."""
    from flexorch.cli.preflight import preflight

    for line in preflight(cfg):
        print(line, flush=True)


def _cmd_train(args: argparse.Namespace) -> int:
    from flexorch.cli.train import run_train

    cfg = _train_config(args)
    _preflight(cfg)
    viewer = None
    if args.dashboard_port is not None:
        from flexorch.dashboards.viewer import ViewerServer

        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        viewer = ViewerServer(cfg.run_dir, port=args.dashboard_port).start()
        print(f"plan viewer: {viewer.url} (while this run lasts; later: flexorch dashboard {cfg.run_dir})", flush=True)
    raw = [a for a in (args.argv or []) if a != "--resume"]
    again = shlex.join(["flexorch", *raw, "--resume"]) if raw else None
    try:
        run_train(cfg, address=args.address, resume_command=again)
    finally:
        if viewer is not None:
            viewer.stop()
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from flexorch.cli.train import run_profile

    cfg = _train_config(args)
    _preflight(cfg)
    run_profile(cfg, args.out, address=args.address)
    return 0


_PLAN_KEYS = {
    "lengths",
    "text_field",
    "workers",
    "profile",
    "heads",
    "window",
    "window_share",
    "max_context",
    "over_long",
    "batch",
    "steps",
    "seed",
    "time_limit",
    "solver_workers",
    "json",
    "svg",
    "run_dir",
    "pipeline_stages",
    "gpus_per_node",
    "nodes",
    "topology",
    "speeds",
}


def _merged(args: argparse.Namespace) -> dict:
    if args.devices is not None:
        raise DataError(
            "--devices was renamed --workers (one word for a device slot in every command): use --workers "
            f"{args.devices}"
        )
    values: dict = {}
    if args.config is not None:
        try:
            values = tomllib.loads(args.config.read_text())
        except FileNotFoundError:
            raise DataError(f"config file {args.config} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise DataError(f"config file {args.config} is not valid TOML: {e}") from None
        values = {k.replace("-", "_"): v for k, v in values.items()}
        if "devices" in values:
            raise DataError(
                f"config file {args.config}: 'devices' was renamed 'workers' (one word for a device slot in every "
                f"command); write workers = {values['devices']!r}"
            )
        unknown = sorted(set(values) - _PLAN_KEYS)
        if unknown:
            raise DataError(f"config file {args.config}: unknown keys {unknown}; known: {sorted(_PLAN_KEYS)}")
    for k in _PLAN_KEYS:
        v = getattr(args, k)
        if v is not None:
            values[k] = v
    return values


def _cmd_plan(args: argparse.Namespace) -> int:
    from flexorch.cli.plan import PlanRunConfig, parse_nodes, parse_pipeline_stages, parse_speeds, run_plan
    from flexorch.solver.planner import PlannerConfig
    from flexorch.solver.profiles import get_profile

    v = _merged(args)
    profile = get_profile(v.get("profile", "gpt-7b-a100"))
    if v.get("heads") is not None:
        profile = profile.with_overrides(num_heads=int(v["heads"]), num_kv_heads=int(v["heads"]))
    profile = with_window(profile, v)
    planner = PlannerConfig(time_limit_s=float(v.get("time_limit", 1.0)), workers=int(v.get("solver_workers", 1)))
    nodes = parse_nodes(v.get("nodes"), v.get("gpus_per_node"), v.get("workers"))
    workers = int(v.get("workers", sum(nodes) if nodes else 64))
    cfg = PlanRunConfig(
        lengths=Path(v["lengths"]) if v.get("lengths") else None,
        text_field=v.get("text_field", "text"),
        workers=workers,
        nodes=nodes,
        speeds=parse_speeds(v.get("speeds"), workers, nodes),
        topology=v.get("topology", "aware"),
        max_context=parse_tokens(v["max_context"]) if v.get("max_context") is not None else None,
        over_long=v.get("over_long", "drop"),
        batch=int(v.get("batch", 512)),
        steps=int(v.get("steps", 10)),
        seed=int(v.get("seed", 0)),
        json=bool(v.get("json", False)),
        svg=Path(v["svg"]) if v.get("svg") else None,
        run_dir=Path(v["run_dir"]) if v.get("run_dir") else None,
        planner=planner,
        pipeline_stages=parse_pipeline_stages(v.get("pipeline_stages")),
    )
    run_plan(cfg, profile)
    return 0


def _cmd_profiles(args: argparse.Namespace) -> int:
    from flexorch.solver.profiles import BUILTIN_PROFILES, get_profile

    if args.name:
        print(get_profile(args.name).to_json())
        return 0
    for name, p in sorted(BUILTIN_PROFILES.items()):
        print(
            f"{name:14s} a1={p.a1_ms:.4g} ms/tok^2  a2={p.a2_ms:.4g} ms/tok  b1={p.b1_ms:.5g} ms  "
            f"{p.tokens_per_device} tokens/worker  L={p.num_layers} h={p.hidden} heads={p.num_heads}"
        )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="flexorch-export-") as tmp:
        src, shown = _local_checkpoint(args.checkpoint, tmp)
        return _export(src, shown, args)


def _local_checkpoint(given: str, tmp: str) -> tuple[Path, str]:
    """The local directory of the checkpoint ``given`` names, and where it is: a checkpoint directory itself, or the
    newest complete checkpoint of a run directory or of a storage; one in an object store is downloaded into ``tmp``
    first."""
    from flexorch.control.checkpoint import latest_checkpoint
    from flexorch.control.checkpoint_store import PREFIX, CheckpointStore

    store = CheckpointStore(given)
    name = store.root.rsplit("/", 1)[-1]
    if name.startswith(PREFIX):
        parent = given.rstrip("/").rsplit("/", 1)[0]
        ckpt = CheckpointStore(parent).checkpoint(name)
    else:
        if not store.remote and (Path(store.root) / "checkpoints").is_dir():
            store = CheckpointStore.of_run(store.root)  # a run directory
        ckpt = latest_checkpoint(store)
        if ckpt is None:
            raise ValueError(f"{given} has no complete checkpoint")
    if not ckpt.store.remote:
        return Path(ckpt.path), ckpt.path
    print(f"downloading {ckpt.path} ...", flush=True)
    return ckpt.store.download(ckpt.name, Path(tmp) / ckpt.name), ckpt.path


def _export(src: Path, shown: str, args: argparse.Namespace) -> int:
    from flexorch.control.checkpoint_export import checkpoint_config, export_model

    model = checkpoint_config(src)["model"]
    if model.get("hf") is not None:
        from flexorch.control.hf_export import export_hf

        got = export_hf(src, args.out)
        tok = f"tokenizer from {got['tokenizer']}" if got["tokenizer"] else "no tokenizer files (byte tokenizer)"
        print(
            f"exported {shown} -> {args.out}/ (Hugging Face format: config.json, {len(got['files'])} safetensors "
            f"file(s), {tok}): "
            f"{got['tensors']} tensors, {got['parameters']:,} parameters, {got['bytes'] / 2**20:.1f} MiB"
        )
        for a in got["adapters"]:
            print(
                f"  adapter {a['task']} -> {a['path']}/ (PEFT LoRA, r={a['rank']}, alpha={a['alpha']:g}, "
                f"{', '.join(a['targets'])}; {a['tensors']} tensors): "
                f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('{args.out}'), '{a['path']}')"
            )
        return 0
    got = export_model(src, args.out)
    print(
        f"exported {shown} -> {args.out}: {got['tensors']} tensors, {got['parameters']:,} parameters, "
        f"{got['bytes'] / 2**20:.1f} MiB"
    )
    tasks = [a["task"] for a in model.get("adapters") or ()]
    if tasks:
        print(
            f"  with the LoRA adapters of tasks {', '.join(tasks)} under flexorch's names "
            "(layers.<i>.lora.<task>.<target>.A/B); PEFT adapter directories are written for [model] hf runs only"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to print the --resume command after a stop
    try:
        commands = {
            "plan": _cmd_plan,
            "profiles": _cmd_profiles,
            "train": _cmd_train,
            "profile": _cmd_profile,
            "dashboard": cmd_dashboard,
            "export": _cmd_export,
            "prepare": cmd_prepare,
        }
        return commands[args.command](args)
    except (ValueError, OSError, RuntimeError) as e:  # PlanningError, DataError, ProfileError are ValueErrors
        print(f"flexorch {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C outside a run, or a second signal during one (flexorch.cli.train)
        print(f"flexorch {args.command}: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
