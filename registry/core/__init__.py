"""The core: operators, composites, transform-stack detection, rules, the selector and routing."""
