"""The seed's own code, copied verbatim: not our code, so do not "fix" it here.

USA-NA-AIO 2025 Round 2, Problem 2 (`shared/seeds/` beside the repository), reference answers of Parts 5 (`MyMHA`),
7 (`MyGQA`: what `convert verify` checks seed-notation checkpoints against), 10 (`GQA_2_MLA`), 13 (`reduced_matrices`).
"""

import numpy as np
import torch
import torch.nn as nn

# ---------------------------------------------------------------- Part 5


class MyMHA(nn.Module):
    def __init__(self, D_1, D_2, D_qk, D_v, H):
        super().__init__()
        self.D_1 = D_1
        self.D_2 = D_2
        self.D_qk = D_qk
        self.D_v = D_v
        self.H = H

        self.W_Q = nn.Linear(in_features=D_1, out_features=H * D_qk, bias=False)
        self.W_K = nn.Linear(in_features=D_2, out_features=H * D_qk, bias=False)
        self.W_V = nn.Linear(in_features=D_2, out_features=H * D_v, bias=False)
        self.W_O = nn.Linear(in_features=H * D_v, out_features=D_1, bias=False)

    def forward(self, x, y):
        B = x.shape[0]  # batch size
        L_1 = x.shape[1]  # the length of sequence x
        L_2 = y.shape[1]  # the length of sequence y

        Q = self.W_Q(x)  # shape: (B,L_1,H*D_qk)
        K = self.W_K(y)  # shape: (B,L_2,H*D_qk)
        V = self.W_V(y)  # shape: (B,L_2,H*D_v)

        Q = Q.reshape(B, L_1, self.H, self.D_qk)  # shape: (B,L_1,H,D_qk)
        K = K.reshape(B, L_2, self.H, self.D_qk)  # shape: (B,L_2,H,D_qk)
        V = V.reshape(B, L_2, self.H, self.D_v)  # shape: (B,L_2,H,D_v)

        Q = Q.permute(0, 2, 1, 3)  # shape: (B,H,L_1,D_qk)
        K = K.permute(0, 2, 1, 3)  # shape: (B,H,L_2,D_qk)
        V = V.permute(0, 2, 1, 3)  # shape: (B,H,L_2,D_v)

        logits = Q @ K.transpose(-2, -1) / (self.D_qk**0.5)  # shape: (B,H,L_1,L_2)
        alpha = torch.softmax(logits, dim=-1)  # shape: (B,H,L_1,L_2)

        O = alpha @ V  # shape: (B,H,L_1,D_v)

        O = O.permute(0, 2, 1, 3)  # shape: (B,L_1,H,D_v)
        O = O.reshape(B, L_1, self.H * self.D_v)  # shape: (B,L_1,H*D_v)
        return self.W_O(O)  # shape: (B,L_1,D_1)


# ---------------------------------------------------------------- Part 7


class MyGQA(nn.Module):
    def __init__(self, D_1, D_2, D_qk, D_v, H, G):
        super().__init__()
        self.D_1 = D_1
        self.D_2 = D_2
        self.D_qk = D_qk
        self.D_v = D_v
        self.H = H
        self.G = G

        self.W_Q = nn.Linear(in_features=D_1, out_features=H * D_qk, bias=False)
        self.W_K = nn.Linear(in_features=D_2, out_features=G * D_qk, bias=False)
        self.W_V = nn.Linear(in_features=D_2, out_features=G * D_v, bias=False)
        self.W_O = nn.Linear(in_features=H * D_v, out_features=D_1, bias=False)

    def forward(self, x, y):
        B = x.shape[0]  # batch size
        L_1 = x.shape[1]  # the length of sequence x
        L_2 = y.shape[1]  # the length of sequence y
        num_copies = self.H // self.G

        Q = self.W_Q(x)  # shape: (B,L_1,H*D_qk)
        K = self.W_K(y)  # shape: (B,L_2,G*D_qk)
        V = self.W_V(y)  # shape: (B,L_2,G*D_v)

        Q = Q.reshape(B, L_1, num_copies, self.G, self.D_qk)  # shape: (B,L_1,num_copies,G,D_qk)
        K = K.reshape(B, L_2, 1, self.G, self.D_qk)  # shape: (B,L_2,1,G,D_qk)
        V = V.reshape(B, L_2, 1, self.G, self.D_v)  # shape: (B,L_2,1,G,D_v)

        Q = Q.permute(0, 2, 3, 1, 4)  # shape: (B,num_copies,G,L_1,D_qk)
        K = K.permute(0, 2, 3, 1, 4)  # shape: (B,1,G,L_2,D_qk)
        V = V.permute(0, 2, 3, 1, 4)  # shape: (B,1,G,L_2,D_v)

        logits = Q @ K.transpose(-2, -1) / (self.D_qk**0.5)  # shape: (B,num_copies,G,L_1,L_2)
        alpha = torch.softmax(logits, dim=-1)  # shape: (B,num_copies,G,L_1,L_2)

        O = alpha @ V  # shape: (B,num_copies,G,L_1,D_v)

        O = O.permute(0, 3, 1, 2, 4)  # shape: (B,L_1,num_copies,G,D_v)
        O = O.reshape(B, L_1, -1)  # shape: (B,L_1,H*D_v)
        return self.W_O(O)  # shape: (B,L_1,D_1)


# ---------------------------------------------------------------- Part 10


def GQA_2_MLA(W_M_GQA):
    r = W_M_GQA.shape[0]
    D = W_M_GQA.shape[1]
    num_copies = D // r

    W_K_GQA_tilde = np.concatenate([W_M_GQA] * num_copies, axis=0)
    U, S, V = np.linalg.svd(W_K_GQA_tilde)
    W_UM_MLA = U[:, :r]
    W_DKV_MLA = S.reshape(-1, 1)[:r, :] * V[:r, :]
    print(f"Shape of W_UK_MLA: {W_UM_MLA.shape}")
    print(f"Shape of W_DKV_MLA: {W_DKV_MLA.shape}")

    MSE = np.mean((W_K_GQA_tilde - W_UM_MLA @ W_DKV_MLA) ** 2)
    print(f"Mean-squared error: {MSE}")

    return W_DKV_MLA, W_UM_MLA


# ---------------------------------------------------------------- Part 13


def reduced_matrices(W_DKV, W_UK, W_UV, W_Q, W_O, H):
    r = W_DKV.shape[0]
    D = W_DKV.shape[1]

    W_K_MLA_hat = W_DKV
    W_V_MLA_hat = W_DKV
    W_Q_MLA_hat = (W_UK.reshape(H, -1, r).transpose(-2, -1) @ W_Q.reshape(H, -1, D)).reshape(-1, D) * (
        r / (D / H)
    ) ** 0.5
    W_O_MLA_hat = (W_O.reshape(D, H, -1).transpose(0, 1) @ W_UV.reshape(H, -1, r)).transpose(0, 1).reshape(D, -1)

    return W_K_MLA_hat, W_V_MLA_hat, W_Q_MLA_hat, W_O_MLA_hat
