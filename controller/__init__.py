"""Control plane: exit forecaster (ARIMA), planner (E3's DP) and the controller.

Not built yet: the foundation serves one fixed plan written by `e3 export`.
The forecaster, planner and controller arrive with their own issue.
"""
