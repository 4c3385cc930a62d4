/* The same transforms as src/main.rs with FFTW 3 (single precision, FFTW_MEASURE plans),
 * one thread, best of 10. See run.sh. */
#include <fftw3.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const int lengths[] = {23232, 307200, 663552, 884736, 589824, 2560};
    double fwd_total = 0, inv_total = 0;
    for (int l = 0; l < 6; l++) {
        int n = lengths[l];
        float *x = fftwf_alloc_real(n);
        fftwf_complex *spec = fftwf_alloc_complex(n / 2 + 1);
        fftwf_plan fwd = fftwf_plan_dft_r2c_1d(n, x, spec, FFTW_MEASURE);
        fftwf_plan inv = fftwf_plan_dft_c2r_1d(n, spec, x, FFTW_MEASURE);
        for (int k = 0; k < n; k++) x[k] = (float)((k * 7919L) % 1000) / 1000.0f - 0.5f;
        double best_fwd = 1e9, best_inv = 1e9;
        for (int r = 0; r < 10; r++) {
            double t = now();
            fftwf_execute(fwd);
            t = now() - t;
            if (t < best_fwd) best_fwd = t;
            t = now();
            fftwf_execute(inv); /* c2r overwrites its input; the next forward refills it */
            t = now() - t;
            if (t < best_inv) best_inv = t;
            for (int k = 0; k < n; k++) x[k] /= (float)n;
        }
        printf("fftw n=%d forward %.3f ms inverse %.3f ms\n", n, best_fwd * 1e3, best_inv * 1e3);
        fwd_total += best_fwd;
        inv_total += best_inv;
        fftwf_destroy_plan(fwd);
        fftwf_destroy_plan(inv);
        fftwf_free(x);
        fftwf_free(spec);
    }
    printf("fftw total forward %.3f ms inverse %.3f ms\n", fwd_total * 1e3, inv_total * 1e3);
    return 0;
}
