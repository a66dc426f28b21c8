"""The cache layer, whatever engine runs the model: one layer's policies, budgets and store.

`layer.PolicyLayer` is what an engine drives (append, begin_call, end_call); `policy_group` holds the
layer's policies and calls them safely; `budgets` turns the plan's budgets into each cell's token limit;
`static_step` is the compiled decode step's fixed-shape path; `memory_report` reads what a layer holds.
"""
