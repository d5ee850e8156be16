/* moed-worker entry point (the standalone runner lands with the CPU forward pass). */
#include <stdio.h>

int main(void)
{
    fprintf(stderr, "moed-worker: the forward pass is not built yet\n");
    return 1;
}
