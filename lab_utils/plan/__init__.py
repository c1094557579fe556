"""Layer 4, the optimization plan: levers and what each buys (`levers`), predicting and verifying
a plan from a measured step (`planner`)."""
