"""kvpolicy in EleutherAI's lm-evaluation-harness: the model type ``kvpolicy`` (`kvpolicy.lmeval.model.KVPolicyLM`).

lm-eval finds a model type only once the module that registers it is imported, and it does not
look for other packages' models by entry point; so run it through ``python -m kvpolicy.lmeval``
(lm-eval's own command line, with this model registered), or import ``kvpolicy.lmeval.model``
before calling ``lm_eval.simple_evaluate``. Needs ``pip install "kvpolicy[lmeval]"``.
"""
