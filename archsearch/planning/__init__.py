"""Planning: training time and cost, memory, and the serving limits of a study (docs/method.md section 8).

Importing this package imports numpy but no torch, scipy or scikit-learn (those load when a
law is fitted or the CPU is measured).
"""

from archsearch.planning.cost import Price, resolve_price
from archsearch.planning.limits import Limits, check_limits
from archsearch.planning.formats import WeightFormat, base_weight_bytes, parse_format
from archsearch.planning.finetune import max_finetune_batch, predict_finetune_memory
from archsearch.planning.memory import (max_inference_batch, max_training_batch, predict_inference_memory,
                                        predict_training_memory)
from archsearch.planning.time import (TimeLaw, TimeLawFit, TrainingEstimate, estimate_training,
                                      fit_time_law, parse_gpus)

__all__ = ["estimate_training", "TrainingEstimate", "TimeLaw", "TimeLawFit", "fit_time_law",
           "parse_gpus", "Limits", "check_limits", "predict_inference_memory",
           "predict_training_memory", "max_inference_batch", "max_training_batch", "Price",
           "resolve_price", "WeightFormat", "parse_format", "base_weight_bytes", "predict_finetune_memory",
           "max_finetune_batch"]
