"""NVML's brand vocabulary, shared by observe (naming what NVML reports) and decide."""

from __future__ import annotations

# NVML brand values (nvmlBrandType_t) -> the names NVIDIA_REQUIRE_BRAND compares to. The one
# copy of this table: observe names the brands NVML reports with it, decide compares them.
BRANDS: dict[int, str] = {
    0: "unknown", 1: "quadro", 2: "tesla", 3: "nvs", 4: "grid", 5: "geforce", 6: "titan",
    7: "nvidiavapps", 8: "nvidiavpc", 9: "nvidiavcs", 10: "nvidiavws", 11: "nvidiacloudgaming",
    12: "quadrortx", 13: "nvidiartx", 14: "nvidia", 15: "geforcertx", 16: "titanrtx",
}
BRAND_IDS: dict[str, int] = {name: num for num, name in BRANDS.items()}
