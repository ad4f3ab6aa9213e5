"""Parse a rendered engine command line with the engine's OWN argument parser; print the result as JSON.

    PYTHON_WITH_VLLM tests/serve/engine_parser_probe.py vllm '["vllm", "serve", ...]'
    python tests/serve/engine_parser_probe.py nemo PATH/TO/deploy_triton.py '["python", "deploy_triton.py", ...]'

vllm: builds the parser exactly as ``vllm serve`` does (``ServeSubcommand.subparser_init``) and runs
vLLM's ``validate_parsed_serve_args``; it needs a Python where vLLM imports (a CPU machine needs
``VLLM_TARGET_DEVICE=cpu`` to build the parser's defaults). nemo: NeMo's deploy_triton.py imports
nemo/TensorRT-LLM at module level, which do not install here, so its ``get_args`` function is taken
from the script's syntax tree and run alone (it uses only argparse).
"""

from __future__ import annotations

import ast
import json
import sys


def vllm(argv: list[str]) -> dict:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))
    args = parser.parse_args(argv[1:])
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    return vars(args)


def nemo(script: str, argv: list[str]) -> dict:
    tree = ast.parse(open(script).read())
    (get_args,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "get_args"]
    namespace: dict = {"argparse": __import__("argparse"), "Optional": __import__("typing").Optional}

    class UsageError(Exception):
        pass

    namespace["UsageError"] = UsageError
    exec(compile(ast.Module(body=[get_args], type_ignores=[]), script, "exec"), namespace)
    return vars(namespace["get_args"](argv[2:]))


if __name__ == "__main__":
    if sys.argv[1] == "vllm":
        parsed = vllm(json.loads(sys.argv[2]))
    else:
        parsed = nemo(sys.argv[2], json.loads(sys.argv[3]))
    print(json.dumps(parsed, default=str))
