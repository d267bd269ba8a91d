"""Reports: plots and tables shared by the CLI, the API and the dashboard."""
