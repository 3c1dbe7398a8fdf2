"""Tools for the tool-runner and multi-turn tests (run inside tool workers, imported by dotted path)."""

import os
import time


def echo(arguments):
    return f"echo:{arguments}"


def upper(arguments):
    return str(arguments["text"]).upper()


def raises(arguments):
    raise ZeroDivisionError("division by zero")


def hangs(arguments):
    time.sleep(3600)
    return "never"


def returns_int(arguments):
    return 42


def floods(arguments):
    return "x" * 100_000


def prints_then_answers(arguments):
    print("noise on stdout that must not reach the reply")
    os.write(1, b"more noise from fd 1\n")
    return "answer"


def exits(arguments):
    os._exit(3)


def connects(arguments):
    import socket

    s = socket.socket()
    s.settimeout(2)
    s.connect(("127.0.0.1", int(arguments)))
    return "connected"


def pid(arguments):
    return str(os.getpid())


def counts_runs(arguments):
    """Appends one line to the file named by `arguments` per run (a tool with a side effect)."""
    with open(arguments, "a") as f:
        f.write("run\n")
    return "done"


def environment(arguments):
    return ",".join(sorted(os.environ))


def counting_calculator(arguments):
    """subtract_tool's calculator that also logs each run to calls.log in its working directory (the runner's
    scratch directory), so a test can count how often a call really ran."""
    from slime.tasks.subtract_tool import calculator

    with open("calls.log", "a") as f:
        f.write(f"{arguments}\n")
    return calculator(arguments)


def slow_counting_calculator(arguments):
    time.sleep(0.3)
    return counting_calculator(arguments)


def _env_with_missing_module():
    from slime.utils.tool_calls import AgentEnv, ToolCallFormat, ToolSpec

    return AgentEnv(tools=(ToolSpec("ghost", "tests.no_such_module.run"),), call_format=ToolCallFormat("[", "]"))


MISSING_TOOL_ENV = _env_with_missing_module()


def flaky_calculator(arguments):
    """subtract_tool's calculator that hangs on a call starting with '9' and raises on one it cannot read (the
    end-to-end test's tool: its failures are named in the ledger and the run goes on)."""
    from slime.tasks.subtract_tool import BAD_CALL, calculator

    if str(arguments).startswith("9"):
        time.sleep(3600)
    answer = calculator(arguments)
    if answer == BAD_CALL:
        raise ValueError(f"cannot subtract {arguments!r}")
    return answer


def _flaky_env():
    from slime.tasks.subtract_tool import BAD_CALL, CALL_FORMAT
    from slime.utils.tool_calls import AgentEnv, ToolSpec

    return AgentEnv(tools=(ToolSpec("calculator", "tests.tool_plugins.flaky_calculator", safe_to_rerun=True),),
                    call_format=CALL_FORMAT, bad_call_output=BAD_CALL)


FLAKY_ENV = _flaky_env()
