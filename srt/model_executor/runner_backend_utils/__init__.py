"""SGLang's runner-backend helpers that model files import (see the submodules)."""
