"""`nemo-dcr` command line: the end-to-end demo, a receiver process, and helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from nemo_dcr.local_s3 import free_port


def make_checkpoint(out: str | os.PathLike, *, family: str = "qwen3", hidden: int = 256, layers: int = 4,
                    heads: int = 8, kv_heads: int = 4, ffn: int = 768, vocab: int = 2000,
                    tied: bool = False, seed: int = 0, experts: int = 4) -> Path:
    """A small random-init Hugging Face checkpoint (BF16 safetensors): version 0.

    `family`: a converter name with a demo model (`registry.demo_families()`); its converter's
    `demo_config` turns the sizes into a transformers config (MoE families: `experts`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_dcr import registry

    config = registry.demo_config(family, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn,
                                  vocab=vocab, tied=tied, experts=experts)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():  # norms at 1.0 would never change at RL learning rates; make them realistic
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)


def cmd_make_checkpoint(args) -> int:
    path = make_checkpoint(args.out, family=args.family, hidden=args.hidden, layers=args.layers,
                           vocab=args.vocab, tied=args.tied, seed=args.seed)
    print(f"wrote version-0 checkpoint to {path}")
    return 0


def cmd_receive(args) -> int:
    """One receiver process: a Hugging Face model refitted in place."""
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_dcr import registry
    from nemo_dcr.history import open_history
    from nemo_dcr.malloc import keep_freed_memory
    from nemo_dcr.receiver import Receiver
    from nemo_dcr.runtimes.hf import HFRuntime

    # The staged records of each refit are freed after its commit and needed again at the
    # next: keeping that memory saves the first touches (page faults) every refit.
    kept = not args.release_memory and keep_freed_memory()
    t = time.perf_counter()
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise SystemExit(f"--device {args.device!r} is not a torch device ({e})") from None
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16).to(device)
    model.eval()
    runtime = HFRuntime(model, checkpoint_dir=args.checkpoint, apply_threads=args.apply_threads)
    transport = registry.transport(args.transport, json.loads(args.transport_config))
    end = transport.receiver(args.id)
    receiver = Receiver(args.id, runtime, end, key=_key(args.key_env), log=lambda m: print(m, flush=True),
                        history=open_history(args.history, transport), rescan=args.rescan,
                        state_digest=not args.no_state_digest, decode_threads=args.decode_threads)
    params = sum(p.numel() for p in model.parameters())
    copied = (f", {runtime.privatized_bytes / 1e9:.2f} GB copied out of the checkpoint's memory map"
              if runtime.privatized_bytes else "")
    print(f"[{args.id}] serving version 0 from {args.checkpoint} on {device} "
          f"({params / 1e6:.1f}M params, loaded in {time.perf_counter() - t:.1f} s{copied}; freed memory "
          f"{'kept for the next refit' if kept else 'returned to the OS'})", flush=True)
    try:
        receiver.serve_forever()
    finally:
        end.close()
    print(f"[{args.id}] shut down at version {receiver.serving_version}", flush=True)
    return 0


def _key(env_var: str | None) -> bytes | None:
    if not env_var:
        return None
    value = os.environ.get(env_var)
    if not value:
        raise SystemExit(f"HMAC key variable {env_var} is not set")
    return value.encode()


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _demo_family(name: str) -> str:
    """argparse type: a converter name with a demo model (the registry's, so a plug-in family counts)."""
    from nemo_dcr import registry

    families = registry.demo_families()
    if name not in families:
        raise argparse.ArgumentTypeError(f"no demo model for family {name!r}; families: {', '.join(families)}")
    return name


_FAMILY_ARGUMENT = dict(default="qwen3", type=_demo_family,
                        help="model family: a registered converter that describes a demo model (default qwen3)")


def cmd_demo(args) -> int:
    if args.encode_threads < 0:
        raise SystemExit(f"--encode-threads must be >= 0 (got {args.encode_threads})")
    if args.ep > 1 and not _has_experts(args.family):
        raise SystemExit(f"--ep {args.ep}: expert parallelism needs an MoE family, not {args.family}")
    if args.ep > 1 and (args.tp * args.dp) % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide TP x DP = {args.tp * args.dp} (expert-TP is 1)")
    if args.sp and args.tp == 1:
        raise SystemExit("--sp splits sequences over the TP ranks: it needs --tp > 1")
    work = Path(args.workdir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    receivers = [f"rx{i}" for i in range(args.receivers)]
    world = args.tp * args.pp * args.dp
    with contextlib.ExitStack() as stack:
        config = _demo_transport_config(args, receivers, stack)
        return _run_demo(args, work, receivers, world, json.dumps(config))


def _has_experts(family: str) -> bool:
    """Whether the family's demo model has routed experts (its converter maps them: `num_experts`)."""
    from nemo_dcr import registry

    config = registry.demo_config(family, hidden=64, layers=1, heads=2, kv_heads=2, ffn=64, vocab=64, tied=False,
                                  experts=2)
    return bool(getattr(registry.converter(family, config), "num_experts", 0))


def _demo_transport_config(args, receivers: list[str], stack: contextlib.ExitStack) -> dict:
    """A transport configuration for the demo, with whatever it needs started on loopback."""
    if args.transport == "local":
        shm = Path(args.shm_dir or f"/dev/shm/nemo-dcr-{os.getpid()}")
        stack.callback(shutil.rmtree, shm, ignore_errors=True)
        return {"dir": str(shm), "timeout_s": args.timeout}
    if args.transport == "relay":
        nodes = [{"id": rx, "endpoint": f"tcp://127.0.0.1:{free_port()}"} for rx in receivers]
        return {"nodes": nodes, "coordinator": f"tcp://127.0.0.1:{free_port()}", "timeout_s": args.timeout}
    if args.transport == "s3":
        if args.s3_endpoint:
            return {"endpoint_url": args.s3_endpoint, "bucket": args.s3_bucket,
                    "prefix": f"nemo-dcr-demo-{os.getpid()}", "timeout_s": args.timeout}
        from nemo_dcr.local_s3 import s3_server  # an S3-compatible server on loopback (moto)

        print("[demo] starting a local S3-compatible server (moto) for the s3 transport", flush=True)
        return {**stack.enter_context(s3_server()), "timeout_s": args.timeout}
    raise SystemExit(f"the demo has no set-up for transport {args.transport!r}; use local, relay or s3")


def _run_demo(args, work: Path, receivers: list[str], world: int, transport_config: str) -> int:
    ckpt = work / "checkpoint-v0"
    print(f"[demo] work dir {work}")
    print(f"[demo] 1/3 creating a version-0 {args.family} checkpoint (BF16 safetensors)", flush=True)
    make_checkpoint(ckpt, family=args.family, layers=args.layers, hidden=args.hidden, tied=args.tied, seed=args.seed)
    shutil.rmtree(work / "coordinator", ignore_errors=True)  # a new version 0: no earlier commits apply
    shutil.rmtree(work / "final", ignore_errors=True)  # nor an earlier run's dumps and results
    (work / "results.jsonl").unlink(missing_ok=True)

    # Receivers and trainer ranks are this interpreter running the installed package's modules.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    print(f"[demo] 2/3 starting {len(receivers)} receiver process(es) (HF transformers, in-place apply)", flush=True)
    procs = [subprocess.Popen([sys.executable, "-m", "nemo_dcr.cli", "receive", "--checkpoint", str(ckpt),
                               "--transport", args.transport, "--transport-config", transport_config,
                               "--id", rx], env=env) for rx in receivers]
    vpp = f" VPP={args.vpp}" if args.vpp else ""
    ep = f" EP={args.ep}" if args.ep > 1 else ""
    sp = " SP" if args.sp else ""
    print(f"[demo] 3/3 training {args.steps} steps on {world} Megatron ranks "
          f"(TP={args.tp}{sp} PP={args.pp}{vpp} DP={args.dp}{ep}) and refitting after each", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "nemo_dcr.demo.trainer", "--checkpoint", str(ckpt), "--family", args.family,
           "--tp", str(args.tp), "--pp", str(args.pp), "--steps", str(args.steps), "--lr", str(args.lr),
           "--op", args.op, "--transport", args.transport, "--transport-config", transport_config,
           "--receivers", ",".join(receivers), "--state-dir", str(work / "coordinator"),
           "--results", str(work / "results.jsonl"), "--shutdown-receivers"]
    if args.vpp:
        cmd += ["--vpp", str(args.vpp)]
    if args.ep > 1:
        cmd += ["--ep", str(args.ep)]
    if args.sp:
        cmd += ["--sp"]
    if args.qkv_residual:
        cmd += ["--qkv-residual"]
    if args.encode_threads:
        cmd += ["--encode-threads", str(args.encode_threads)]
    if args.dump:
        cmd += ["--dump-dir", str(work / "final")]
    try:
        rc = subprocess.call(cmd, env=env)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.terminate()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = work / "results.jsonl"
    steps = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    exact = bool(steps) and all(s["bit_exact"] for s in steps) and len(steps) == args.steps
    if args.dump:
        exact &= _compare_dumps(work / "final", receivers)
    print(f"[demo] {len(steps)}/{args.steps} refits committed, bit-exact on every receiver: "
          f"{'yes' if exact else 'NO'}; results in {results}")
    return 0 if rc == 0 and exact else 1


def _compare_dumps(folder: Path, receivers: list[str]) -> bool:
    """Every receiver's final state, read from its dump: the whole-state digest computed
    anew from every element must be the producers' committed one (what the trainer wrote
    to trainer.json), and the receivers must agree with each other element by element."""
    from safetensors.torch import load_file

    from nemo_dcr.digest import state_digest
    from nemo_dcr.verify import bit_mismatches

    if not (folder / "trainer.json").exists():  # the trainer stopped before the final dumps
        print("[demo] no committed state digest from the trainer to compare with")
        return False
    want = json.loads((folder / "trainer.json").read_text())
    first, ok = None, True
    for rx in receivers:
        path = folder / f"{rx}.safetensors"
        state = load_file(path) if path.exists() else None
        if state is None:
            bad = ["<no dump>"]
        else:
            got = state_digest(state).hex()
            bad = [] if got == want["state_digest"] else [f"state digest {got}, the producers' {want['state_digest']}"]
            if first is None:
                first = (rx, state)
            else:
                bad += [f"{name} differs from {first[0]}'s" for name in bit_mismatches(first[1], state)]
        print(f"[demo] final state of {rx} (its dump, every element) vs the producers' committed version "
              f"{want['version']}: {'identical' if not bad else f'{len(bad)} problems: {bad[:5]}'}")
        ok &= not bad
    return ok


def cmd_project(args) -> int:
    """Project a refit at cluster scale from per-byte costs measured on this machine."""
    import dataclasses

    from nemo_dcr.projection import Cluster, ConditionedCosts, measure_costs, project, report

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Cluster)}
    problems = [f"--{n.replace('_', '-')} must be positive (got {v})" for n, v in values.items() if v <= 0]
    if not 0 < values["change_rate"] <= 1:
        problems.append(f"--change-rate must be in (0, 1] (got {values['change_rate']})")
    if values["fanout"] < 2:
        problems.append(f"--fanout must be at least 2 (got {values['fanout']})")
    if problems:
        raise SystemExit("nemo-dcr project: " + "; ".join(problems))
    print(f"[project] measuring per-byte costs on this machine ({args.elements / 1e6:.0f}M elements)...", flush=True)
    costs = measure_costs(values["change_rate"], elements=args.elements)
    result = project(Cluster(**values), costs)
    conditioned = project(Cluster(**values), costs, ConditionedCosts())
    print(report(result, conditioned))
    if args.json:
        Path(args.json).write_text(json.dumps({**result.as_dict(), "conditioned": conditioned.as_dict()}, indent=2))
        print(f"[project] wrote {args.json}")
    return 0


def cmd_curve_keygen(args) -> int:
    """A new CURVE secret key for the relay transport's `curve_secret_env`."""
    import zmq

    _, secret = zmq.curve_keypair()
    print("# put this in the environment variable named by the relay transport's curve_secret_env", file=sys.stderr)
    print(secret.decode())
    return 0


def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    import dataclasses

    from nemo_dcr.projection import Cluster

    for f in dataclasses.fields(Cluster):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                            help=f"(default {f.default:g})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="nemo-dcr", description="Delta-Compressed Refit")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="end-to-end refit demo: Megatron trainer -> HF receivers")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--tp", type=int, default=2)
    d.add_argument("--pp", type=int, default=1)
    d.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per PP rank (needs --pp > 1)")
    d.add_argument("--dp", type=int, default=2)
    d.add_argument("--receivers", type=int, default=2)
    d.add_argument("--lr", type=float, default=1e-6)
    d.add_argument("--op", default="auto", choices=["auto", "xor", "add", "overwrite"],
                   help="how changes travel; auto: xor or add per tensor, whichever codes smaller")
    d.add_argument("--family", **_FAMILY_ARGUMENT)
    d.add_argument("--ep", type=int, default=1, help="expert parallelism for the MoE families (divides TP x DP)")
    d.add_argument("--sp", action="store_true", help="sequence parallelism (MoE with TP > 1 trains only with it)")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--hidden", type=int, default=256)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--encode-threads", type=int, default=0,
                   help="per trainer rank: threads that encode payloads while the rank diffs on")
    d.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    d.add_argument("--qkv-residual", action="store_true",
                   help="convert fused QKV as a residual (recompute + overwrite) instead of affine pieces")
    d.add_argument("--dump", action="store_true",
                   help="after the last step, also check every element of each receiver's dumped final state")
    d.add_argument("--transport", default="local", choices=["local", "relay", "s3"])
    d.add_argument("--s3-endpoint", help="use this S3 endpoint instead of starting a local server")
    d.add_argument("--s3-bucket", default="nemo-dcr")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds any peer may stay silent")
    d.add_argument("--workdir", help="where the checkpoint, state and results go (default: runs/demo-<time> "
                                     "in the current directory)")
    d.add_argument("--shm-dir")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("receive", help="run one receiver process (HF transformers runtime)")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--id", required=True)
    r.add_argument("--transport", default="local")
    r.add_argument("--transport-config", default="{}")
    r.add_argument("--device", default="cpu",
                   help="where the model is served and refitted, a torch device: cpu (default), cuda, cuda:1")
    r.add_argument("--key-env", help="environment variable holding the HMAC key")
    r.add_argument("--history", help="catch up from this refit history when behind or uncertain: a directory, "
                                     "or 's3' (the s3 transport's bucket)")
    r.add_argument("--release-memory", action="store_true",
                   help="hand memory freed after each refit back to the OS (default: keep it for the next "
                        "refit, see nemo_dcr/malloc.py)")
    r.add_argument("--apply-threads", type=_positive_int, default=None,
                   help="threads for the pause's in-place apply (default: the cores this process may use, "
                        "at most 8)")
    r.add_argument("--decode-threads", type=_positive_int, default=None,
                   help="threads that decode a payload's records when it is staged (default: the cores this "
                        "process may use)")
    r.add_argument("--rescan", action="store_true",
                   help="read the whole-state digest from the model again at every begin (O(model)), so that "
                        "bits changed outside refits are caught there")
    r.add_argument("--no-state-digest", action="store_true",
                   help="keep no whole-state digest (no proof of the base at begin nor of the state before the "
                        "commit; saves its O(model) read at start and its cost per change)")
    r.set_defaults(func=cmd_receive)

    m = sub.add_parser("make-checkpoint", help="write a small random version-0 HF checkpoint")
    m.add_argument("out")
    m.add_argument("--family", **_FAMILY_ARGUMENT)
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--vocab", type=int, default=2000)
    m.add_argument("--tied", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_checkpoint)

    j = sub.add_parser("project", help="project a refit at cluster scale (defaults: the paper's 1T setting)",
                       description="Measures per-byte costs here, then projects each refit stage for the "
                                   "described cluster and prints every assumption. Defaults: 1T params at 3%%, "
                                   "32 GB300 producers, 64 H100 receivers, 5 Gbit/s per node across regions.")
    _add_cluster_arguments(j)
    j.add_argument("--elements", type=int, default=1 << 24, help="synthetic tensor size for the measurements")
    j.add_argument("--json", help="also write the projection as JSON here")
    j.set_defaults(func=cmd_project)

    k = sub.add_parser("curve-keygen", help="print a new CURVE secret key for an encrypted relay tree")
    k.set_defaults(func=cmd_curve_keygen)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
