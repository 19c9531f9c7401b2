"""qosd proxy in front of a real OpenAI-compatible server that no one here wrote:
Hugging Face transformers' own `transformers serve`, on the CPU, with a tiny random
Llama written at run time (no weights are downloaded).

    python scripts/real_server_check.py [--venv /tmp/qosd-real-server]

Installs ``transformers[serving]`` and the CPU build of torch into a virtual
environment of its own (torch from the machine's local wheel where there is one), so
none of it enters qosd's. Then it starts the server and ``qosd proxy`` in front of it,
and calls the proxy with the official ``openai`` SDK: a completion, a stream that does
not ask for usage and one that does, and checks that every lease ended with the usage
the server reported. It prints what it saw as JSON and exits 1 when a check fails.
This is not in the test suite: it installs about 1 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
from openai.types.chat import ChatCompletionMessageParam

from qosd_harness import reserve_port, start_command, stop_process

TINY_MODEL = """
import sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
out = Path(sys.argv[1])
words = ["<unk>", "<s>", "</s>", "user", "assistant", ":"] + [f"w{i}" for i in range(250)]
tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer.decoder = decoders.WordPiece(prefix="##")
fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                               unk_token="<unk>")
fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                      "{% endfor %}assistant :")
fast.save_pretrained(out)
config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                     max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=True)
LlamaForCausalLM(config).save_pretrained(out)
"""


def install(venv: Path) -> float:
    """Seconds it took (0 when the environment was there already)."""
    python = venv / "bin" / "python"
    if python.exists():
        return 0.0
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build on this disk
    subprocess.run([*pip, "transformers[serving]"], check=True)
    return time.monotonic() - began


def wait_until_up(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("transformers serve did not start") from None
            time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv", type=Path, default=Path(tempfile.gettempdir()) / "qosd-real-server"
    )
    args = parser.parse_args()
    seen: dict[str, object] = {"install_s": round(install(args.venv), 1)}
    python = args.venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        model = str(work / "tiny-llama")
        subprocess.run([str(python), "-c", TINY_MODEL, model], check=True)
        # transformers serve (uvicorn) takes a port, it does not report one: a reserved
        # one, held while it runs, so that no other process takes it or answers for it.
        reservation = reserve_port()
        port = reservation.port
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with (work / "serve.log").open("ab") as log:
            server = subprocess.Popen(
                [str(args.venv / "bin" / "transformers"), "serve", "--host", "127.0.0.1",
                 "--port", str(port)], stdout=log, stderr=log, env=env,
            )  # fmt: skip
        proxy = None
        try:
            upstream = f"http://127.0.0.1:{port}"
            wait_until_up(upstream, server, 120)
            proxy, ready = start_command(
                ["proxy", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0",
                 "--http-listen", "127.0.0.1:0", "--upstream",
                 f"{model}={upstream}"], work, "proxy",
            )  # fmt: skip
            client = openai.OpenAI(base_url=f"http://{ready['address']}/v1", api_key="unused")
            messages: list[ChatCompletionMessageParam] = [
                {"role": "user", "content": "w1 w2 w3 w4"}
            ]
            answer = client.chat.completions.create(
                model=model, messages=messages, max_tokens=5,
                extra_headers={"x-qos-class": "P0"},
            )  # fmt: skip
            seen["completion_usage"] = answer.usage.model_dump() if answer.usage else None
            chunks = list(client.chat.completions.create(
                model=model, messages=messages, max_tokens=5, stream=True,
            ))  # fmt: skip
            seen["stream_chunks"] = len(chunks)
            seen["stream_usage_chunks_unasked"] = sum(1 for c in chunks if c.usage is not None)
            asked = list(client.chat.completions.create(
                model=model, messages=messages, max_tokens=5, stream=True,
                stream_options={"include_usage": True},
            ))  # fmt: skip
            usages = [c.usage.model_dump() for c in asked if c.usage is not None]
            seen["stream_usage_asked"] = usages
            status = json.loads(urllib.request.urlopen(
                f"http://{ready['http']}/v1/status").read())  # fmt: skip
            seen["active_leases_after"] = int(status["pools"][0]["active_leases"])
            metrics = urllib.request.urlopen(f"http://{ready['http']}/metrics").read().decode()
            seen["proxy_requests_200"] = sum(
                float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("qosd_proxy_requests_total") and 'code="200"' in line
            )  # fmt: skip
        finally:
            if proxy is not None:
                stop_process(proxy)
            stop_process(server)
            reservation.close()
    print(json.dumps(seen, indent=2))
    ok = (
        seen["completion_usage"] is not None
        and seen["stream_usage_chunks_unasked"] == 0
        and len(usages) == 1
        and seen["active_leases_after"] == 0
        and seen["proxy_requests_200"] == 3
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
