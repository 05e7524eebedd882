"""Numbers from scored items: scores (scored items -> a set's metrics) and paired (two models
compared item by item: wins, losses, the delta and its 95% interval).

Imported by the stages that score and report (evaluate, register, tracking, inference); imports
nothing of stages/.
"""
