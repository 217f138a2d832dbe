"""`stagemesh gateway`'s flags, declared without importing what runs it (services/gateway/main.py, imported when
the command runs), so --help and a flag's error come at once."""

from __future__ import annotations

import os

from services.gateway.config import API_KEY_ENV, OPERATOR_KEY_ENV, GatewayConfig
from services.process.args import add_config_args, add_model_args, add_otlp_args, config_from_args, later
from services.process.keys import add_join_token_arg, add_security_args
from shared.config import GATEWAY_PORT, SchedulerConfig


def register(sub) -> None:
    p = sub.add_parser("gateway", help="serve the API in front of running stages",
                       description="OpenAI-compatible API, websocket stream and chat page over a pipeline of stages.")
    add_model_args(p, dtype=False)
    p.add_argument("--stages", default=None,
                   help="comma-separated stage HTTP URLs in pipeline order, or one pattern with {i} and --num-stages")
    p.add_argument("--num-stages", type=int, default=None, help="with a --stages pattern: how many stages")
    p.add_argument("--pipeline", action="append", default=[], metavar="URL,URL,...",
                   help="one pipeline's stage HTTP URLs in order, or one pattern with {i} and --num-stages (instead "
                        "of --stages); repeat for each replica of the model: requests are routed by prefix cache, session and load, and fail over between them")
    p.add_argument("--listen", default=f"127.0.0.1:{GATEWAY_PORT}",
                   help=f"HOST:PORT to serve HTTP on (default 127.0.0.1:{GATEWAY_PORT})")
    p.add_argument("--result-listen", action="append", default=[], metavar="ADDR",
                   help="ZeroMQ address the last stage sends results to (bound here; default tcp://127.0.0.1:5599); "
                        "with several --pipeline, one per pipeline in the same order, or one whose port is the first "
                        "of consecutive ports")
    p.add_argument("--first-stage", default=None, help="ZeroMQ address of stage 0 (default: from its /info; one "
                                                       "pipeline only)")
    p.add_argument("--split", default=None, choices=["auto"],
                   help="auto: before it reports ready, move each pipeline to the split its stages' calibrations "
                        "balance (start every stage with --calibrate ROWS; the stages give the split otherwise)")
    add_config_args(p, SchedulerConfig)
    add_config_args(p, GatewayConfig)
    add_otlp_args(p)
    add_security_args(p)
    add_join_token_arg(p)
    p.set_defaults(func=later("services.gateway.main:cmd_gateway"))


def gateway_config_from_args(args, model: str) -> GatewayConfig:
    """The GatewayConfig of `gateway`'s (or `up`'s) flags, the model's name and $STAGEMESH_API_KEY; validated. The
    model's name in the API is --served-model-name, else --model as given when it is an alias, else the file's name
    without .gguf (never a path of this machine)."""
    name = args.served_model_name or os.path.basename(model).removesuffix(".gguf")
    return config_from_args(GatewayConfig, args, model_id=name, api_key=os.environ.get(API_KEY_ENV) or None,
                            operator_key=os.environ.get(OPERATOR_KEY_ENV) or None)
