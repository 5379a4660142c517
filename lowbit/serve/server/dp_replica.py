"""One data-parallel replica: an Engine in its own (spawned) process, stepping while it has work and taking the
front's commands over a pipe between steps. Messages to the front: ("ready", info) | ("failed", line) |
("added", request_id, error or None) | ("outs", [RequestOutput]) | ("metrics", token, text, kv blocks used)."""
import sys


def main(index: int, model: str, config: dict, conn, threads: int | None) -> None:
    import torch

    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine

    if threads:
        torch.set_num_threads(threads)
    try:
        engine = Engine(model, EngineConfig(**config))
    except Exception as e:  # reported by the front as one line naming the replica
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("ready", {"max_model_len": engine.max_model_len, "num_blocks": engine.runner.num_blocks,
                         "kv_dtype": str(engine.runner.kv_dtype), "device": str(engine.runner.device),
                         "vocab_size": engine.runner.model.config["vocab_size"],
                         "eos_token_ids": sorted(engine.eos_token_ids)}))
    try:
        while _commands(engine, conn):
            if engine.has_unfinished():
                outs = engine.step()
                if outs:
                    conn.send(("outs", outs))
    finally:
        engine.close()


def _commands(engine, conn) -> bool:
    """Runs the queued commands (waiting for one when idle); False on stop or when the front is gone."""
    try:
        if not engine.has_unfinished():
            conn.poll(None)
        while conn.poll():
            command = conn.recv()
            if command[0] == "stop":
                return False
            _run(engine, conn, *command)
    except (EOFError, OSError):  # the front process ended: nothing is left to serve
        return False
    return True


def _run(engine, conn, kind: str, *args) -> None:
    if kind == "add":
        request_id, prompt, params, stream, prompt_text = args
        try:
            engine.add_request(request_id, prompt, params, stream, prompt_text)
        except Exception as e:  # the caller's: a ValueError is its 400, anything else its 500
            conn.send(("added", request_id, e))
            return
        conn.send(("added", request_id, None))
    elif kind == "abort":
        engine.abort(*args)
    elif kind == "metrics":
        conn.send(("metrics", args[0], engine.metrics.render(engine.gauges()), engine.block_manager.num_used_blocks))
    else:
        raise ValueError(f"unknown replica command {kind!r}")
