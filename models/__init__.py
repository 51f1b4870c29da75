"""The early-exit models themselves, in PyTorch: the interface, the zoo, their data, training and evaluation.

api.py          :class:`EarlyExitModel`, the interface every part works from (implement it for your own model)
zoo/            the shipped models (tiny-ee, bert-ee, bert-base-ee, pabee, resnet-ee) and their stock twins
data/           data sets that install from the package registries (text and images), as model inputs
recipes.py      how each zoo model is trained (``e3 train``); training.py runs a recipe
checkpoints.py  where trained weights live and how they are found again
reference.py    the reference early-exit inference every served form must equal
evaluate.py     ``e3 evaluate``: accuracy and exits against the threshold
workload.py     ``e3 workload``: easy/hard mixes and the batch profiles the planner reads
user_data.py    a user's own data file (``--data``) as model inputs

Nothing here starts a server; ``export/`` writes these models as Triton repositories.
"""
