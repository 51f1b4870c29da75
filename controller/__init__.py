"""Control plane: exit forecaster (ARIMA), planner (E3's DP) and the controller.

forecast.py     router telemetry on Triton's metrics port -> window batch profiles -> forecasts
planner.py      E3's dynamic program: cuts, replicas, device configurations, batch size (pure)
triton_api.py   load / unload / instance counts / plan switch through Triton's repository API
controller.py   the control loop that ties them together (`e3 control`, `e3 status`)
"""
