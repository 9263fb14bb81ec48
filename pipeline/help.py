"""`--help`: the trainer's own config groups described, beside the library's (steadfast/help.py lists them all)."""

from __future__ import annotations

from steadfast.help import GROUP_HELP

GROUP_HELP.update(
    {
        "model": "the network; model._target_=my.module.MyNet plugs in your own",
        "data": "the dataset; data._target_ plugs in your own",
        "task": "what is optimised and measured (the loss); task._target_ plugs in your own",
        "experiment": "committed presets (conf/experiment/)",
    }
)
