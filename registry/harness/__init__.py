"""The checking harness: sample inputs, the transform-stack interpreter, audits and the verified matrix."""
