"""Phase e: one completion end to end through a gateway, a prefill and a decode process.

The checkpoint (SmolLM2's shape on the GPU, the small stand-in on the CPU) gets an offline
tokenizer: a byte-level BPE whose merges are pairs of byte symbols, built in memory to the
model's vocabulary size (every id decodes), with ChatML special tokens and a chat template;
common.tokenizer must load it, round-trip a text and render the template. Then bootstrap,
prefill_node and decode_node run as `pdserve launch` runs them (one process each, the
cluster token in the environment), on `--device`, KV over NIXL when it is importable (else
the fake backend, which moves no bytes: said in the result). One HTTP completion with
max_tokens 16 and ignore_eos must return 16 tokens (finish_reason "length"); the same
prompt with n = 3, greedy, three equal choices (the other samples copy the first one's
last page on the decode device and sample from its logits on the prefill one); the prompt
scored (echo, logprobs, max_tokens 0), a finite logprob per token after the first; and
each process must exit 0 on SIGTERM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from device_check_common import ROOT, Deadline, Mode, Sink, checkpoint, log

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_TOKENS = 16
# the runners the phase's node processes make on the GPU: a prefill and a decode node
GPU_CONFIGS = [("smollm2-135m", "bfloat16", False), ("smollm2-135m", "bfloat16", True)]
REQUEST_TIMEOUT_S = 30.0


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE of exactly `vocab_size` ids saved beside the checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    # ASCII letters first, so ordinary words merge into pairs
    order = sorted(alphabet, key=lambda c: (not (c.isascii() and c.isalpha()), c))
    merges: list[tuple[str, str]] = []
    for a in order:
        for b in order:
            if len(vocab) >= vocab_size:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(path))


def check_tokenizer(path: Path, vocab_size: int) -> dict[str, Any]:
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(path)
    text = "The device check says hello, world."
    ids = tok.encode(text)
    chat = tok.apply_chat_template([{"role": "user", "content": text}])
    ok = (
        tok.vocab_size == vocab_size
        and tok.decode(ids) == text
        and 2 in tok.eos_token_ids
        and len(chat) > len(ids)
        and tok.decode(list(range(vocab_size))) is not None
    )
    return dict(
        kind="tokenizer",
        vocab_size=tok.vocab_size,
        num_ids=len(ids),
        num_chat_ids=len(chat),
        eos_ids=sorted(tok.eos_token_ids),
        ok=ok,
    )


def _free_ports(n: int) -> list[int]:
    """n distinct free ports below the kernel's ephemeral range. Ports from bind(0) come from
    that range, where the processes' own port-0 sockets (zmq, the nodes' HTTP) may be handed
    the same port before the bootstrap binds it: "address already in use" at start-up."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng, held, ports = secrets.SystemRandom(), [], []
    try:
        while len(ports) < n:
            port = rng.randrange(max(1024, low // 2), low)
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)  # held until all are chosen: distinct
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


class _Proc:
    """A role process; a thread keeps its last output lines and notes its READY line."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        from common.ready import parse_ready

        self.name = name
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.log_path = log_dir / f"{name}.log"
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )

        def read() -> None:
            assert self.popen.stdout is not None
            with open(self.log_path, "w") as f:
                for line in self.popen.stdout:
                    f.write(line)
                    if parse_ready(line) is not None:
                        self.ready.set()
                    self.lines.append(line.rstrip())
                    del self.lines[:-40]

        threading.Thread(target=read, daemon=True).start()

    def stop(self, timeout: float) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
                return None  # did not exit on SIGTERM
        return self.popen.returncode


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _complete(api: int, timeout: float, **changes: Any) -> dict[str, Any]:
    body = {
        "model": "devcheck",
        "prompt": "The device check says",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **changes,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{api}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


def _cluster(
    path: Path, mode: Mode, backend: str, deadline: Deadline, work: Path
) -> dict[str, Any]:
    api, registry, reply = _free_ports(3)
    env = dict(os.environ, PDSERVE_AUTH_TOKEN=secrets.token_urlsafe(24), OMP_WAIT_POLICY="PASSIVE")
    if not mode.is_cpu:
        env.setdefault("UCX_TLS", "tcp,self,sm,cuda_copy,cuda_ipc")
    py = sys.executable
    node = [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--bootstrap-url",
        f"http://127.0.0.1:{registry}",
        "--model-path",
        str(path),
        "--device",
        "cpu" if mode.is_cpu else "cuda:0",  # named: the device check runs on cuda:0
        "--dtype",
        mode.speed_dtype,
        "--disaggregation-transfer-backend",
        backend,
        "--max-total-tokens",
        "4096",
    ]
    if not mode.is_cpu:
        node += ["--cuda-graph-max-bs", "8"]
    logs = work / f"e2e-{backend}"
    logs.mkdir(parents=True, exist_ok=True)
    procs = [
        _Proc(
            "bootstrap",
            [
                py,
                "-m",
                "bootstrap",
                "--host",
                "127.0.0.1",
                "--port",
                str(api),
                "--disaggregation-bootstrap-port",
                str(registry),
                "--reply-port",
                str(reply),
                "--model-path",
                str(path),
                "--served-model-name",
                "devcheck",
            ],
            env,
            logs,
        )
    ]
    procs += [
        _Proc(f"{role}-0", [py, "-m", module, *node, "--node-id", f"{role}-0"], env, logs)
        for role, module in (("prefill", "prefill_node"), ("decode", "decode_node"))
    ]
    out: dict[str, Any] = dict(
        kind="e2e", transfer_backend=backend, moves_bytes=backend == "nixl", ok=False
    )
    started = time.monotonic()
    try:
        while not all(p.ready.is_set() for p in procs):
            dead = [p.name for p in procs if p.popen.poll() is not None]
            if dead or deadline.left() < 10:
                out["error"] = f"exited during start-up: {dead}" if dead else "start-up too slow"
                return out
            time.sleep(0.2)
        while True:
            try:
                nodes = _get(f"http://127.0.0.1:{api}/nodes")["nodes"]
                if sum(1 for n in nodes if n.get("healthy")) >= 2:
                    break
            except OSError:
                pass
            if deadline.left() < 10:
                out["error"] = "the nodes never registered healthy"
                return out
            time.sleep(0.2)
        out["startup_s"] = round(time.monotonic() - started, 2)
        t0 = time.monotonic()
        # a KV transfer that hangs must leave time for the retry without it
        reply = _complete(api, timeout=max(5.0, min(REQUEST_TIMEOUT_S, deadline.left() - 8)))
        out["request_s"] = round(time.monotonic() - t0, 3)
        choice = reply["choices"][0]
        out.update(
            completion_tokens=reply.get("usage", {}).get("completion_tokens"),
            finish_reason=choice.get("finish_reason"),
            text=choice.get("text", "")[:80],
        )
        # n = 3 greedy: one prefill and one transfer; the other samples copy the first's
        # last page on the decode device and take their first token from its logits
        samples = _complete(api, timeout=max(5.0, min(30.0, deadline.left() - 8)), n=3)
        texts = [c.get("text") for c in samples["choices"]]
        out["n_choices_equal"] = len(texts) == 3 and all(t == choice.get("text") for t in texts)
        # the prompt's logprobs (echo): computed on the prefill node's device for every
        # position, through the transfer's control message to the gateway
        scored = _complete(
            api,
            timeout=max(5.0, min(30.0, deadline.left() - 8)),
            max_tokens=0,
            echo=True,
            logprobs=1,
        )
        values = scored["choices"][0]["logprobs"]["token_logprobs"]
        out.update(
            prompt_tokens=scored.get("usage", {}).get("prompt_tokens"),
            prompt_logprobs=len(values),
            prompt_logprobs_finite=values[0] is None
            and all(isinstance(v, float) and -1e4 < v <= 0 for v in values[1:]),
        )
    except Exception as exc:  # noqa: BLE001 - the result says what broke
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        codes = {p.name: p.stop(20) for p in reversed(procs)}  # nodes first, gateway last
        out["exit_codes"] = codes
        if "error" in out or any(c != 0 for c in codes.values()):
            out["log_tails"] = {p.name: p.lines[-8:] for p in procs}
            for p in procs:  # into the run's log (device_check.log), which comes back
                log(f"{backend}: last lines of {p.name}:\n" + "\n".join(p.lines))
    out["ok"] = (
        "error" not in out
        and out.get("completion_tokens") == MAX_TOKENS
        and out.get("finish_reason") == "length"
        and out.get("prompt_logprobs") == out.get("prompt_tokens")
        and out.get("prompt_logprobs_finite") is True
        and out.get("n_choices_equal") is True
        and all(c == 0 for c in out["exit_codes"].values())
    )
    return out


def run(mode: Mode, sink: Sink, work: Path, deadline: Deadline) -> None:
    name = "small" if mode.is_cpu else "smollm2-135m"
    path = checkpoint(name, work, mode.device)
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    if not (path / "tokenizer.json").exists():
        save_tokenizer(path, vocab)
    sink.emit(model=name, **check_tokenizer(path, vocab))
    backend = "nixl" if importlib.util.find_spec("nixl") is not None else "fake"
    log(f"e2e: {name} on {mode.device}, transfer {backend}")
    result = _cluster(path, mode, backend, deadline, work)
    if backend == "fake":
        result["note"] = "NIXL is not installed here: the fake backend moved no KV bytes"
    sink.emit(model=name, **result)
    if not result["ok"] and backend == "nixl" and deadline.left() > (30 if mode.is_cpu else 45):
        # the same cluster without NIXL: does the rest of the path work?
        sink.emit(
            model=name,
            **{
                **_cluster(path, mode, "fake", deadline, work),
                "note": "retry without NIXL (moves no KV bytes)",
                "kind": "e2e_without_nixl",
            },
        )
