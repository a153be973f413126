"""The rules layer: goodput, power, the validator, recourse and expected goodput.

Every rule of the model (docs/model.md) is written here once; planners and
workflows call these functions instead of re-deriving them.
"""
